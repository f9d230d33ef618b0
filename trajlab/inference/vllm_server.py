"""The vllm backend driving an engine that runs as its own server (``vllm serve``), the usual layout on a GPU node:
the trainer on some GPUs, the engine on others.

Rollouts go over the server's OpenAI API token in, token out (:class:`OpenAIGenerator`: ``/v1/completions`` with the
episode's token ids and ``return_token_ids``). After each RL update the trained LoRA adapter is written to a folder the
server reads and loaded through vLLM's adapter endpoints under a new name, the previous one unloaded: requests then
name the new adapter, so no cached prefix computed by an older adapter is reused. The base weights never move.

The server must run with ``--enable-lora --max-lora-rank R`` (R at least ``rl.lora.r``) and
``--logprobs-mode processed_logprobs`` (the logprobs the trainer computes), with
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` in its environment. Full weights cannot be sent to an external server yet:
RL with one trains LoRA.
"""

from __future__ import annotations

import json
import shutil
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

from trajlab.errors import UserError
from trajlab.inference.openai_client import OpenAIGenerator, ServerError

SERVER_FLAGS = ("vllm serve MODEL --enable-lora --max-lora-rank R --logprobs-mode processed_logprobs, with "
                "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True in its environment")


class VLLMServerGenerator(OpenAIGenerator):
    """Rollouts on a ``vllm serve`` process, and the trained adapter loaded into it after each update.

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

    def load_weights(self, model: Any) -> None:
        """Load ``model``'s LoRA adapter into the server under a new name and roll out with it from now on."""
        if not hasattr(model, "peft_config"):
            raise UserError(f"the vLLM server at {self.base_url} takes LoRA adapters only: train with rl.lora "
                            "(--lora-r), or use the in-process engine (no model.vllm.server) for full weights.")
        version = self.weight_loads + 1
        name = f"trajlab-policy-v{version}"
        folder = self.adapter_dir / name
        model.save_pretrained(folder)  # adapter_config.json and the adapter's tensors only
        self._post("load_lora_adapter", {"lora_name": name, "lora_path": str(folder)})
        previous, self.model = self.model, name
        if previous != self.base_model:
            self._post("unload_lora_adapter", {"lora_name": previous})
            shutil.rmtree(self.adapter_dir / previous, ignore_errors=True)
        self.weight_loads = version

    def sleep(self) -> None:
        """Nothing: the server's memory is its own, on its own devices."""

    def wake_up(self) -> None:
        """Nothing (see :meth:`sleep`)."""

    def _post(self, endpoint: str, body: dict[str, Any]) -> None:
        url = f"{self.base_url}/{endpoint}"
        request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST", headers={
            "Content-Type": "application/json", "Authorization": f"Bearer {self.api_key}"})
        try:
            with urllib.request.urlopen(request, timeout=120):
                return
        except urllib.error.HTTPError as exc:
            raise ServerError(f"{url} answered HTTP {exc.code}: {exc.read().decode(errors='replace')[:500]}. The "
                              f"server must run as: {SERVER_FLAGS}; and read {self.adapter_dir}.") from exc
        except OSError as exc:
            raise ServerError(f"cannot reach {url} ({exc}): is the vLLM server still running?") from exc
