"""Where a model runs and in what precision: the devices and dtypes ``model.device`` and ``model.dtype`` name."""

from __future__ import annotations

import ctypes
import functools
import logging
import platform
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where used: the config reads AUTO, and every command reads the config
    import torch

logger = logging.getLogger(__name__)

AUTO = "auto"
"""The device and dtype trajlab picks (see :func:`resolve_device`, :func:`resolve_dtype`): the default of
``model.device`` and ``model.dtype``, and of the loaders called without them."""


def resolve_device(name: str | torch.device = AUTO) -> torch.device:
    """The torch device ``model.device`` names: ``auto`` is the GPU when torch sees one, else the CPU.

    Raises:
        ValueError: not a device trajlab runs on, or a GPU that torch does not see.
    """
    import torch

    if isinstance(name, torch.device):
        return name
    if name == AUTO:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ValueError(f"device {name!r} is not one trajlab runs on: use auto, cpu, cuda or cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r}: torch {torch.__version__} sees no CUDA GPU on this machine; use --device "
                        "cpu (or auto, which picks the GPU when there is one)")
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"device {name!r}: torch sees {torch.cuda.device_count()} GPU(s), numbered from cuda:0")
    return device


def resolve_dtype(name: str | torch.dtype, device: torch.device, saved: torch.dtype | None = None) -> torch.dtype:
    """The weights' dtype ``model.dtype`` names on ``device``, for a checkpoint saved in ``saved``.

    ``auto`` is float32 on the CPU (its half-precision kernels are slow) and the checkpoint's own dtype on a GPU,
    except a bfloat16 checkpoint on a GPU without bfloat16, which loads in float32. float32 checkpoints stay float32:
    ask for bfloat16 to halve their memory.

    Raises:
        ValueError: an unknown dtype, or bfloat16 on a GPU that does not support it.
    """
    import torch

    if isinstance(name, torch.dtype):
        return name
    bf16_ok = device.type != "cuda" or torch.cuda.is_bf16_supported()
    if name == AUTO:
        if device.type != "cuda":
            return torch.float32
        chosen = saved or torch.float32
        return torch.float32 if chosen == torch.bfloat16 and not bf16_ok else chosen
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(name)
    if dtype is None:
        raise ValueError(f"dtype {name!r} is not one trajlab loads models in: use auto, float32, bfloat16 or float16")
    if dtype == torch.bfloat16 and not bf16_ok:
        raise ValueError(f"dtype bfloat16: {torch.cuda.get_device_name(device)} does not support it; use float16 or "
                        "float32")
    if dtype == torch.bfloat16 and device.type == "cpu" and not cpu_has_bfloat16_units():
        _warn_emulated_bfloat16()
    return dtype


def cpu_has_bfloat16_units() -> bool:
    """Whether this x86 CPU computes bfloat16 in hardware (AVX512-BF16 or AMX); True elsewhere (not known).

    Without them torch's CPU kernels convert every bfloat16 operand: on an AVX2 host one SFT step of the Llama-3.2-1B
    one-layer twin ran more than 20 minutes in bfloat16 and 33 s in float32.
    """
    import torch

    if platform.machine().lower() not in ("x86_64", "amd64"):
        return True
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


@functools.cache
def _warn_emulated_bfloat16() -> None:
    import torch

    logger.warning("model.dtype bfloat16 on a CPU without bfloat16 instructions (torch sees %s, no AVX512-BF16 or "
                   "AMX): its matmuls run converted, often 10x slower than float32. Use float32 (or auto) unless "
                   "memory forces bfloat16.", torch.backends.cpu.get_cpu_capability())


def release_freed_memory() -> None:
    """Hand the pages of memory already freed back to the system (glibc's ``malloc_trim``; nothing on other C
    libraries).

    glibc serves a block below its mmap threshold from its heaps, and the threshold rises to the largest block freed
    (up to 32 MB): with a real vocabulary, a batch's float32 logits rows ((B, V), 10-20 MB). Freed in between
    longer-lived blocks, such blocks stay resident: one RL step's rollouts and update on Qwen3's vocabulary kept over
    1 GB that torch had freed (BENCHMARKS.md, "Memory: whole RL steps"). Trimming between phases returns it.
    """
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    if sys.platform != "linux" or platform.libc_ver()[0] != "glibc":
        return None
    return ctypes.CDLL("libc.so.6")
