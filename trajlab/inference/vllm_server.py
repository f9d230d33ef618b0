"""The vllm backend driving an engine that runs as its own server (``vllm serve``), the usual layout on a GPU node:
the trainer on some GPUs, the engine on others.

Rollouts go over the server's OpenAI API token in, token out (:class:`OpenAIGenerator`: ``/v1/completions`` with the
episode's token ids and ``return_token_ids``). After each RL update the server gets the new policy:

- **LoRA**: the trained adapter is written to a folder the server reads and loaded through vLLM's adapter endpoints
  under a new name, the previous one unloaded: requests then name the new adapter, so no cached prefix computed by an
  older adapter is reused. The base weights never move. The server runs with ``--enable-lora --max-lora-rank R``
  (R at least ``rl.lora.r``) and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` in its environment.
- **Full weights**: through vLLM's RL weight-update protocol: generation is paused (requests kept), the weights are
  broadcast in packed buckets over a process group of their own (:mod:`trajlab.inference.weight_broadcast`; the
  server's side is the ``trajlab_gloo`` backend that trajlab's vLLM plugin registers), the prefix cache is dropped
  and generation resumes. The server runs with ``--weight-transfer-config '{"backend": "trajlab_gloo"}'`` and
  ``VLLM_SERVER_DEV_MODE=1`` (which exposes the protocol's endpoints), with trajlab installed beside vLLM.

Either way the server runs with ``--logprobs-mode processed_logprobs`` (the logprobs the trainer computes).
"""

from __future__ import annotations

import json
import shutil
import urllib.error
import urllib.request
from concurrent.futures import FIRST_EXCEPTION, wait
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

from trajlab.inference import weight_broadcast
from trajlab.inference.openai_client import OpenAIGenerator, ServerError

SERVER_FLAGS = ("vllm serve MODEL --logprobs-mode processed_logprobs, and for LoRA --enable-lora --max-lora-rank R "
                "with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True in its environment, for full weights "
                "--weight-transfer-config '{\"backend\": \"trajlab_gloo\"}' with VLLM_SERVER_DEV_MODE=1 in its "
                "environment (and trajlab installed beside vLLM)")


class VLLMServerGenerator(OpenAIGenerator):
    """Rollouts on a ``vllm serve`` process, and the trained policy loaded into it after each update (its LoRA
    adapter, or every weight).

    Args:
        base_url: the server's API root, e.g. ``http://gpu-node:8000/v1``.
        model: the base model's name on the server (``served_model(base_url)``).
        tokenizer: the model's tokenizer.
        adapter_dir: where adapters are written; the server must read the same path (one machine, or a shared disk).
        **options: :class:`OpenAIGenerator`'s.
    """

    def __init__(self, base_url: str, model: str, tokenizer: PreTrainedTokenizerBase, *, adapter_dir: str | Path,
                 **options: Any) -> None:
        super().__init__(base_url, model, tokenizer, **options)
        self.base_model = model
        self.adapter_dir = Path(adapter_dir).resolve()
        self.weight_loads = 0
        self.sent_bytes = 0
        """Bytes of full weights broadcast to the server so far."""
        self._root = self.base_url.removesuffix("/v1")
        self._group: Any = None

    def load_weights(self, model: Any) -> None:
        """Hand the server ``model``'s weights: a PEFT model's adapter alone, else every weight."""
        if hasattr(model, "peft_config"):
            self.load_adapter(model)
        else:
            self.load_full_weights(model)

    def load_adapter(self, model: Any) -> None:
        """Load ``model``'s LoRA adapter into the server under a new name and roll out with it from now on."""
        version = self.weight_loads + 1
        name = f"trajlab-policy-v{version}"
        folder = self.adapter_dir / name
        model.save_pretrained(folder)  # adapter_config.json and the adapter's tensors only
        self._post(f"{self.base_url}/load_lora_adapter", {"lora_name": name, "lora_path": str(folder)})
        previous, self.model = self.model, name
        if previous != self.base_model:
            self._post(f"{self.base_url}/unload_lora_adapter", {"lora_name": previous})
            shutil.rmtree(self.adapter_dir / previous, ignore_errors=True)
        self.weight_loads = version

    def connect_weight_transfer(self) -> None:
        """Open the full-weight transfer group with the server (once; :meth:`load_full_weights` does it when
        needed): the server's engine ranks join the trainer's rendezvous while the trainer serves it."""
        if self._group is not None:
            return
        engines = self._call(f"{self._root}/get_world_size")["world_size"]
        host, port = weight_broadcast.trainer_endpoint(self._root)
        init = {"master_address": host, "master_port": port, "rank_offset": 1, "world_size": engines + 1}
        serving = weight_broadcast.in_thread(weight_broadcast.open_group, host, port, 0, engines + 1)
        self._post(f"{self._root}/init_weight_transfer_engine", {"init_info": init})  # returns once its ranks joined
        self._group = serving.result(timeout=weight_broadcast.TIMEOUT_S)

    def load_full_weights(self, model: Any) -> None:
        """Broadcast every weight of ``model`` to the server in buckets, generation paused meanwhile (requests
        kept), then drop its prefix cache (computed with the old weights) and resume. A server that fails the
        update fails it at once (the broadcast, stuck without its receiver, is left to time out in its thread) and
        the next sync opens a new transfer group."""
        from trajlab.inference.weights import full_weights

        self.connect_weight_transfer()
        weights = dict(full_weights(model))
        description = weight_broadcast.describe(weights.items())
        self._post(f"{self._root}/pause?mode=keep", {})
        try:
            self._post(f"{self._root}/start_weight_update", {})
            self.sent_bytes += self._send_while_received(weights, description)
            self._post(f"{self._root}/finish_weight_update", {})
            # Requests kept through the pause are preempted and recomputed with the new weights.
            reset = self._post(f"{self._root}/reset_prefix_cache?reset_running_requests=true", {})
            if not reset.get("success"):
                raise ServerError(f"the vLLM server at {self._root} could not drop its prefix cache after a weight "
                                  "update: its cached prefixes were computed with the old weights")
        finally:
            self._post(f"{self._root}/resume", {})
        self.weight_loads += 1

    def _send_while_received(self, weights: dict[str, Any], description: dict[str, list]) -> int:
        """The broadcast while the server receives inside its ``update_weights`` call, each in a thread of its own;
        the first to fail is raised at once (the other, stuck without its peer, times out in its thread), and the
        group, left mid-transfer, is dropped. The bytes sent."""
        sending = weight_broadcast.in_thread(weight_broadcast.send, self._group, weights.items(), description)
        receiving = weight_broadcast.in_thread(self._post, f"{self._root}/update_weights", {"update_info": description})
        wait([sending, receiving], timeout=weight_broadcast.TIMEOUT_S, return_when=FIRST_EXCEPTION)
        try:
            for future in (receiving, sending):
                if future.done() and future.exception() is not None:
                    raise future.exception()
            receiving.result(timeout=0)
            return sending.result(timeout=0)
        except BaseException:
            self._group = None
            raise

    def sleep(self) -> None:
        """Nothing: the server's memory is its own, on its own devices."""

    def wake_up(self) -> None:
        """Nothing (see :meth:`sleep`)."""

    def _post(self, url: str, body: dict[str, Any]) -> dict[str, Any]:
        return self._call(url, json.dumps(body).encode())

    def _call(self, url: str, data: bytes | None = None) -> dict[str, Any]:
        """GET ``url`` (POST ``data`` when given); the JSON answer (an empty dict for any other)."""
        request = urllib.request.Request(url, data=data, method="GET" if data is None else "POST", headers={
            "Content-Type": "application/json", "Authorization": f"Bearer {self.api_key}"})
        try:
            with urllib.request.urlopen(request, timeout=weight_broadcast.TIMEOUT_S) as answer:
                body = answer.read()
        except urllib.error.HTTPError as exc:
            raise ServerError(f"{url} answered HTTP {exc.code}: {exc.read().decode(errors='replace')[:500]}. The "
                              f"server must run as: {SERVER_FLAGS}.") from exc
        except OSError as exc:
            raise ServerError(f"cannot reach {url} ({exc}): is the vLLM server still running?") from exc
        try:
            answer = json.loads(body)
        except ValueError:
            return {}
        return answer if isinstance(answer, dict) else {}

