"""Weights broadcast in packed buckets over a gloo group of their own (the trainer's side and the engine's side of
the full-weight sync to a vLLM server), between two ranks on loopback."""

from __future__ import annotations

import socket
import threading

import pytest
import torch

from trajlab.inference import weight_broadcast


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def weights() -> list[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    wide = torch.randn(6, 40, generator=generator)
    return [
        ("embed.weight", torch.randn(50, 8, generator=generator).to(torch.bfloat16)),
        ("embed.scale", torch.randn(3, generator=generator).to(torch.bfloat16)),  # 6 bytes: the next is misaligned
        ("layer.0.norm", torch.randn(8, generator=generator)),
        ("layer.0.proj", wide[:, ::2]),  # not contiguous
        ("layer.0.big", torch.randn(64, 64, generator=generator)),  # larger than a bucket: travels alone
        ("position_ids", torch.arange(12)),
        ("head.bias", torch.randn(3, generator=generator).to(torch.float16)),
    ]


def test_every_weight_arrives_bit_exact_in_buckets_no_larger_than_the_bound_but_for_a_lone_big_one() -> None:
    sent = weights()
    description = weight_broadcast.describe(sent, bucket_bytes=1024)
    assert description["names"] == [name for name, _ in sent]
    assert description["dtype_names"][0] == "bfloat16" and description["shapes"][3] == [6, 20]
    assert sum(description["buckets"]) == len(sent) and len(description["buckets"]) > 2
    start = 0
    for count in description["buckets"]:
        sizes = [t.numel() * t.element_size() for _, t in sent[start:start + count]]
        assert count == 1 or sum(sizes) <= 1024
        start += count

    port, loaded, counts = free_port(), [], {}

    def engine() -> None:
        group = weight_broadcast.open_group("127.0.0.1", port, 1, 2, timeout_s=60)
        counts["received"] = weight_broadcast.receive(group, description, lambda bucket: loaded.append(
            [(name, tensor.clone()) for name, tensor in bucket]))

    receiver = threading.Thread(target=engine)
    receiver.start()
    group = weight_broadcast.open_group("127.0.0.1", port, 0, 2, timeout_s=60)
    counts["sent"] = weight_broadcast.send(group, sent, description)
    receiver.join(timeout=60)

    assert [len(bucket) for bucket in loaded] == description["buckets"], "one load per bucket"
    got = [pair for bucket in loaded for pair in bucket]
    assert [name for name, _ in got] == [name for name, _ in sent]
    for (_, want), (_, have) in zip(sent, got, strict=True):
        assert have.dtype == want.dtype and have.shape == want.shape and torch.equal(have, want)
    assert counts["sent"] == counts["received"] == sum(t.numel() * t.element_size() for _, t in sent)


def test_a_weight_that_is_not_the_one_described_stops_before_its_bucket_goes_out() -> None:
    sent = weights()
    description = weight_broadcast.describe(sent)
    swapped = [sent[2], sent[0], sent[1], *sent[3:]]
    group = weight_broadcast.open_group("127.0.0.1", free_port(), 0, 1, timeout_s=10)
    with pytest.raises(ValueError, match=r"weight 0 is \('layer.0.norm'.*receiver was told \('embed.weight'"):
        weight_broadcast.send(group, swapped, description)
    with pytest.raises(ValueError, match="fewer weights than described"):
        weight_broadcast.send(group, sent[:2], description)


def test_the_trainer_endpoint_is_the_address_its_traffic_to_the_server_leaves_from() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        host, port = weight_broadcast.trainer_endpoint(f"http://127.0.0.1:{server.getsockname()[1]}/v1")
    assert host == "127.0.0.1" and 0 < port < 65536
