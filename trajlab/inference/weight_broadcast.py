"""Weights streamed from the trainer to an inference engine in another process: packed buckets broadcast over a
process group of their own, the trainer at rank 0.

Both ends are here, so they cannot disagree on the wire: the trainer describes the weights (names, dtypes, shapes and
how many go into each bucket), sends that description over the engine's control plane (an HTTP call), then
broadcasts each bucket as one flat byte buffer; the engine allocates each bucket from the description, receives it
and hands its tensors, viewed in place, to the model's loader. One bucket at a time is packed and on the wire.

The group is gloo (CPU tensors, any machine) and owns no global state: it is made from a ``TCPStore`` directly, so
it lives beside whatever process group the trainer or the engine already has.
"""

from __future__ import annotations

import datetime
import itertools
import math
import socket
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from typing import Any
from urllib.parse import urlparse

import torch
import torch.distributed as dist

BUCKET_BYTES = 256 * 2**20
"""Bytes a bucket holds (a tensor larger than this travels alone): one bucket is in flight at a time."""
TIMEOUT_S = 300.0


def open_group(host: str, port: int, rank: int, world_size: int, timeout_s: float = TIMEOUT_S) -> Any:
    """Join the transfer group: rank 0 (the trainer) serves the rendezvous at ``host:port``, the others connect."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout)
    return dist.ProcessGroupGloo(store, rank, world_size, timeout)


def in_thread(function: Callable[..., Any], *args: Any) -> Future:
    """``function(*args)`` in a daemon thread, its future: for a collective (a rendezvous, a broadcast) that the caller
    must be free to give up on when the peer fails, rather than wait out its timeout."""
    done: Future = Future()

    def run() -> None:
        try:
            done.set_result(function(*args))
        except BaseException as exc:  # noqa: BLE001 - raised by whoever reads the future
            done.set_exception(exc)

    threading.Thread(target=run, name="trajlab-weight-transfer", daemon=True).start()
    return done


def trainer_endpoint(server_url: str) -> tuple[str, int]:
    """An address of this machine the server at ``server_url`` can reach (the one its traffic leaves from), and a
    free port on it, for the trainer to serve the rendezvous at."""
    parsed = urlparse(server_url)
    with socket.create_connection((parsed.hostname, parsed.port or 80), timeout=10) as probe:
        host = probe.getsockname()[0]
    return host, free_port(host)


def free_port(host: str) -> int:
    """A port on ``host`` nothing listens on now, for the trainer to serve a rendezvous at."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def describe(weights: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int = BUCKET_BYTES) -> dict[str, list]:
    """What the receiver needs to take the broadcast apart: each weight's name, dtype and shape, in order, and how
    many consecutive weights each bucket packs."""
    names, dtypes, shapes, buckets = [], [], [], []
    filled = bucket_bytes
    for name, tensor in weights:
        size = tensor.numel() * tensor.element_size()
        if filled + size > bucket_bytes or not buckets:
            buckets.append(0)
            filled = 0
        buckets[-1] += 1
        filled += size
        names.append(name)
        dtypes.append(str(tensor.dtype).removeprefix("torch."))
        shapes.append(list(tensor.shape))
    return {"names": names, "dtype_names": dtypes, "shapes": shapes, "buckets": buckets}


def send(group: Any, weights: Iterable[tuple[str, torch.Tensor]], description: dict[str, list]) -> int:
    """Broadcast ``weights`` (the ones :func:`describe` described, in the same order) bucket by bucket; the bytes
    sent. A weight that is not the one described stops the transfer with an error naming it, before its bucket
    goes out (the receiver would otherwise cut the bytes wrongly)."""
    pairs, sent, index = iter(weights), 0, 0
    for count in description["buckets"]:
        bucket = []
        for name, tensor in _take(pairs, count):
            _check(description, index, name, tensor)
            bucket.append(tensor.detach().contiguous().reshape(-1).view(torch.uint8).cpu())
            index += 1
        flat = torch.cat(bucket)
        _broadcast(group, flat)
        sent += flat.numel()
    return sent


def receive(group: Any, description: dict[str, list], load: Callable[[list[tuple[str, torch.Tensor]]], Any]) -> int:
    """Receive the broadcast :func:`describe` described, and hand each bucket's weights to ``load`` as views of the
    received bytes; the bytes received."""
    received = 0
    for names, dtypes, shapes in _buckets(description):
        sizes = [math.prod(shape) * _dtype(name).itemsize for shape, name in zip(shapes, dtypes, strict=True)]
        flat = torch.empty(sum(sizes), dtype=torch.uint8)
        _broadcast(group, flat)
        weights, offset = [], 0
        for name, dtype, shape, size in zip(names, dtypes, shapes, sizes, strict=True):
            data = flat[offset:offset + size]
            if offset % _dtype(dtype).itemsize:  # after an odd-sized weight of a narrower dtype: copied to align it
                data = data.clone()
            weights.append((name, data.view(_dtype(dtype)).view(shape)))
            offset += size
        load(weights)
        received += flat.numel()
    return received


def _take(pairs: Iterator[tuple[str, torch.Tensor]], count: int) -> list[tuple[str, torch.Tensor]]:
    taken = list(itertools.islice(pairs, count))
    if len(taken) < count:
        raise ValueError(f"fewer weights than described: a bucket wanted {count}, {len(taken)} were left")
    return taken


def _check(description: dict[str, list], index: int, name: str, tensor: torch.Tensor) -> None:
    expected = (description["names"][index], description["dtype_names"][index], description["shapes"][index])
    got = (name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape))
    if got != expected:
        raise ValueError(f"weight {index} is {got}, but the receiver was told {expected}: describe() and send() "
                         "must see the same weights in the same order")


def _buckets(description: dict[str, list]) -> Iterator[tuple[list[str], list[str], list[list[int]]]]:
    start = 0
    for count in description["buckets"]:
        end = start + count
        yield (description["names"][start:end], description["dtype_names"][start:end],
               description["shapes"][start:end])
        start = end


def _broadcast(group: Any, flat: torch.Tensor) -> None:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([flat], options).wait()


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in a weight description")
    return dtype

