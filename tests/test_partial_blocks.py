"""Partial blocks: a request that says how many of its tokens arrived (``Incoming.tokens``).

The oracle's sender sends only the blocks that hold those tokens, each whole; the bytes
after them keep their sentinel. After the receive the request reads back its first
``tokens`` tokens through the local layout and zero bytes for every token after them,
and every block outside the batch kept its bytes. Every backend target.
"""

from __future__ import annotations

import pytest
import torch
from kvhost_torch.backend import TorchBackend

import kvhost
from kvhost.testing import ReceiveCase, make_cache

BLOCK = 8  # local tokens per block
LAYOUTS = {
    "KBNHC/NHD": ("KBNHC", "KBNHC", dict(K=2, H=2, C=4)),
    "KBNHC/HND": ("KBNHC", "KBHNC", dict(K=2, H=2, C=4)),
    "BKNHC": ("BKNHC", "BKNHC", dict(K=2, H=2, C=4)),  # K inside the block region
    "BNHKC": ("BNHKC", "BNHKC", dict(K=2, H=2, C=4)),  # K and V interleaved per head
    "BHNC/BHNC": ("BHNC", "BHNC", dict(H=3, C=4)),  # vLLM 0.33's default layer view
    "BHNC/BNHC": ("BHNC", "BNHC", dict(H=3, C=4)),
    "BHNC/HBNC": ("BHNC", "HBNC", dict(H=3, C=4)),
    "LBHNC/BHLNC": ("LBHNC", "BHLNC", dict(L=2, H=2, C=4)),
    "BNC/MLA": ("BNC", "BNC", dict(C=8)),
}
# (kind, k): local = k x remote ("r") or remote = k x local ("g").
RATIOS = [("r", 1), ("r", 2), ("r", 4), ("g", 2), ("g", 4)]


def remote_orders(physical: str) -> list[str]:
    """The local region order and the one with every letter but C reversed: head-major
    against token-major, K outside against inside."""
    region = physical[physical.index("B") + 1 :]
    others = region[:-1]
    return sorted({region, others[::-1] + "C"})


def token_counts(kind: str, k: int) -> tuple[int, list[int]]:
    """(blocks per request, tokens per request): ends inside a sender block, on a sender
    block's end, on a local block's end, in the first and the last unit, and all."""
    if kind == "r":
        n = BLOCK // k
        return 3, sorted({1, n, n + 1, BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK + n - 1, 3 * BLOCK})
    unit = k * BLOCK
    return 2 * k, sorted({1, BLOCK - 1, BLOCK, BLOCK + 3, unit, unit + 1, 2 * unit - 2, 2 * unit})


CASES = [
    pytest.param(name, kind, k, order, id=f"{name}-{kind}{k}-{order}")
    for name, (_, physical, _) in LAYOUTS.items()
    for kind, k in RATIOS
    for order in remote_orders(physical)
]


def caches_for(layout: str, blocks: int, device: str, dtype: torch.dtype = torch.bfloat16):
    axes, physical, sizes = LAYOUTS[layout]
    sizes = dict(sizes, B=blocks, N=BLOCK)
    return axes, physical, {f"layer{i}": make_cache(axes, physical, sizes, dtype, device) for i in range(2)}


@pytest.mark.parametrize(("layout", "kind", "k", "order"), CASES)
def test_partial_requests_read_what_arrived_then_zeros(target, layout, kind, k, order):
    per_request, counts = token_counts(kind, k)
    blocks = per_request * len(counts) + 3  # three blocks no request names
    axes, physical, caches = caches_for(layout, blocks, target.device)
    if target.device == "xla" and physical != axes:
        pytest.skip("XLA tensors have no strides: their memory order is their shape order")
    remote_size = BLOCK // k if kind == "r" else BLOCK * k
    case = ReceiveCase(caches, axes, seed=k)
    order_of_ids = torch.randperm(blocks, generator=torch.Generator().manual_seed(blocks)).tolist()
    requests = {}
    for i, tokens in enumerate(counts):
        ids = order_of_ids[i * per_request : (i + 1) * per_request]
        case.send(f"t{tokens}", ids, order, remote_size, tokens=tokens)
        requests[f"t{tokens}"] = kvhost.Incoming(ids, order, remote_size, tokens=tokens)
    stats = kvhost.receive(caches, requests, axes=axes, backend=target.backend)
    case.check()
    assert stats.blocks == per_request * len(counts)
    full = per_request * BLOCK
    assert stats.zeroed_blocks == sum(-(-(full - t) // BLOCK) if t % BLOCK else (full - t) // BLOCK for t in counts)


DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.int8, torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("kind", "k"), [("r", 4), ("g", 2)])
def test_partial_blocks_in_every_kv_dtype(target, dtype, kind, k):
    axes, _, caches = caches_for("BKNHC", 12, target.device, dtype)
    remote_size = BLOCK // k if kind == "r" else BLOCK * k
    case = ReceiveCase(caches, axes, seed=5)
    ids = [7, 2, 9, 4][: 2 * (k if kind == "g" else 1)]
    case.send("x", ids, "KHNC", remote_size, tokens=BLOCK + 3)
    kvhost.receive(
        caches, {"x": kvhost.Incoming(ids, "KHNC", remote_size, tokens=BLOCK + 3)}, axes=axes, backend=target.backend
    )
    case.check()


@pytest.mark.parametrize("dtype", [torch.uint16, torch.uint32, torch.uint64, torch.float32], ids=str)
def test_partial_blocks_are_zeroed_as_bytes_whatever_torch_can_index(target, dtype):
    """Zeroing works on the bytes: in dtypes torch has no ``index_fill_`` for (uint16 and up)
    and in a cache that requires grad (where torch refuses an in-place op on a leaf), the
    tail is zeroed after the rearrangement, as in any other cache; before, both raised after
    the bytes had moved."""
    if target.device == "xla":
        pytest.skip("the XLA backend zeroes through its own bitcasts (not checked in these dtypes)")
    axes, _, caches = caches_for("BKNHC", 12, target.device, dtype)
    case = ReceiveCase(caches, axes, seed=6)
    case.send("x", [7, 2], "KHNC", 2, tokens=BLOCK + 3)
    if dtype.is_floating_point:
        for tensor in caches.values():
            tensor.requires_grad_(True)
    stats = kvhost.receive(
        caches, {"x": kvhost.Incoming([7, 2], "KHNC", 2, tokens=BLOCK + 3)}, axes=axes, backend=target.backend
    )
    case.check()
    assert stats.zeroed_blocks == 1


def test_partial_and_whole_requests_of_several_senders_in_one_call(target):
    """One call: a request with tokens beside requests without, of three sender layouts."""
    axes, _, caches = caches_for("KBNHC/NHD", 16, target.device)
    case = ReceiveCase(caches, axes, seed=9)
    senders = {
        "a": ([3, 8], "HNC", 2, 11),
        "b": ([1, 5], "NHC", 16, 9),  # token-major both sides: identity, but its tail is zeroed
        "c": ([12], "HNC", 4, None),
        "d": ([0, 6, 14], "NHC", 8, 17),  # same order and size: nothing rearranged, tail zeroed
    }
    requests = {}
    for name, (ids, order, size, tokens) in senders.items():
        case.send(name, ids, order, size, tokens=tokens)
        requests[name] = kvhost.Incoming(ids, order, size, tokens=tokens)
    stats = kvhost.receive(caches, requests, axes=axes, backend=target.backend)
    case.check()
    assert stats.zeroed_blocks == 3  # the last block of a, b and d, each from a token on


def incoming(case: ReceiveCase) -> dict[str, kvhost.Incoming]:
    """The requests ``case`` sent, as the receive call is handed them (with their tokens)."""
    return {
        name: kvhost.Incoming(w.block_ids, w.remote_order, w.remote_block_size, tokens=w.tokens)
        for name, w in case.requests.items()
    }


class Recording(TorchBackend):
    """The torch backend, remembering the units each receive job rearranged."""

    name = "recording"

    def __init__(self) -> None:
        super().__init__()
        self.units: list[list[list[int]]] = []
        self.zeros: list[tuple[list[int], list[int], list[int]]] = []

    def receive(self, job):
        self.units.append(job.unit_ids.tolist())
        super().receive(job)

    def zero(self, job):
        self.zeros.append((job.whole_ids.tolist(), job.partial_ids.tolist(), job.partial_from.tolist()))
        super().zero(job)


def test_units_that_received_nothing_are_zeroed_not_rearranged():
    axes, _, caches = caches_for("KBNHC/HND", 24, "cpu")
    backend = Recording()
    case = ReceiveCase(caches, axes, seed=2)
    # g = 2: units of two local blocks. 19 tokens: unit [4, 9] whole, unit [11, 2] its first block partly.
    case.send("g", [4, 9, 11, 2, 20, 21], "HNC", 16, tokens=19)
    # r = 4: 5 tokens arrive in blocks of 2: block 7 rearranged, tokens 5.. zeroed; 13 received nothing.
    case.send("r", [7, 13], "HNC", 2, tokens=5)
    requests = incoming(case)
    kvhost.receive(caches, requests, axes=axes, backend=backend)
    case.check()
    assert sorted(backend.units) == [[[4, 9], [11, 2]], [[7]]]
    assert backend.zeros == [([2, 20, 21, 13], [11, 7], [3, 5])]


def test_a_batch_without_tokens_never_plans_a_zero():
    axes, _, caches = caches_for("KBNHC/HND", 8, "cpu")
    backend = Recording()
    stats = kvhost.receive(caches, {"a": kvhost.Incoming([1, 2], "HNC", 4)}, axes=axes, backend=backend)
    assert backend.zeros == [] and stats.zeroed_blocks == 0


def test_tokens_that_fill_every_block_named_zero_nothing():
    """The last token in the last token slot of the last block: nothing to zero, so no zero
    call at all, for r and g units alike, and the wire bytes land as without ``tokens``."""
    axes, _, caches = caches_for("KBNHC/HND", 24, "cpu")
    backend = Recording()
    case = ReceiveCase(caches, axes, seed=3)
    case.send("g", [4, 9, 11, 2], "HNC", 16, tokens=4 * BLOCK)
    case.send("r", [7, 13], "HNC", 2, tokens=2 * BLOCK)
    requests = incoming(case)
    stats = kvhost.receive(caches, requests, axes=axes, backend=backend)
    case.check()
    assert sorted(backend.units) == [[[4, 9], [11, 2]], [[7], [13]]]
    assert backend.zeros == [] and stats.zeroed_blocks == 0


def test_tokens_that_end_at_a_block_end_zero_the_later_blocks_whole_and_none_in_part():
    axes, _, caches = caches_for("KBNHC/HND", 24, "cpu")
    backend = Recording()
    case = ReceiveCase(caches, axes, seed=4)
    case.send("r", [7, 13, 5], "HNC", 2, tokens=BLOCK)  # block 7 full; 13 and 5 received nothing
    requests = incoming(case)
    stats = kvhost.receive(caches, requests, axes=axes, backend=backend)
    case.check()
    assert backend.units == [[[7]]]
    assert backend.zeros == [([13, 5], [], [])] and stats.zeroed_blocks == 2


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (kvhost.Incoming([1, 2], "HNC", 4, tokens=0), r"request 'bad': tokens must be a positive integer, got 0"),
        (kvhost.Incoming([1, 2], "HNC", 4, tokens=True), r"request 'bad': tokens must be a positive integer, got True"),
        (kvhost.Incoming([1, 2], "HNC", 4, tokens=3.0), r"request 'bad': tokens must be a positive integer, got 3.0"),
        (kvhost.Incoming([1, 2], "HNC", 4, tokens="3"), r"request 'bad': tokens must be a positive integer, got '3'"),
        (
            kvhost.Incoming([1, 2], "HNC", 4, tokens=17),
            r"request 'bad': tokens=17 do not fit in the 2 block ids named \(2 x 8 = 16 tokens\)",
        ),
        (kvhost.Incoming([1], "HNC", 16, tokens=3), r"request 'bad': 1 block ids are not whole groups of 2"),
        (kvhost.Incoming([], "HNC", 4, tokens=1), r"request 'bad': tokens=1 do not fit in the 0 block ids"),
    ],
)
def test_bad_token_counts_are_refused_before_a_byte_moves(request_, message):
    axes, _, caches = caches_for("KBNHC/HND", 8, "cpu")
    case = ReceiveCase(caches, axes, seed=4)
    case.send("ok", [3, 4], "HNC", 4, tokens=9)
    before = case.snapshot()
    good = kvhost.Incoming([3, 4], "HNC", 4, tokens=9)
    with pytest.raises(kvhost.RequestError, match=message):
        kvhost.receive(caches, {"ok": good, "bad": request_}, axes=axes)
    assert case.same_as(before)


def test_one_block_cut_and_one_zeroed_whole(target):
    """A request alone: its second block cut from a token on, its third zeroed whole (as many
    blocks cut as zeroed whole)."""
    axes, _, caches = caches_for("KBNHC/NHD", 6, target.device)
    case = ReceiveCase(caches, axes, seed=3)
    case.send("x", [4, 0, 2], "HNC", BLOCK, tokens=BLOCK + 3)
    stats = kvhost.receive(
        caches, {"x": kvhost.Incoming([4, 0, 2], "HNC", BLOCK, tokens=BLOCK + 3)}, axes=axes, backend=target.backend
    )
    case.check()
    assert stats.zeroed_blocks == 2
