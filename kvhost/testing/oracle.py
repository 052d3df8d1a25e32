"""The conformance oracle: truth in logical axes, wire bytes as a sender writes them.

Used by kvhost's own suite and by any backend or integration that wants the same
checks. It is written from the wire model (docs/design.md), not from kvhost's planner: per outer
index, a request's local block regions concatenated in block order hold the sender's
blocks concatenated in token order, each sender block laid out in the remote order.
All comparisons are on raw bytes, so NaN payloads and fp8 compare exactly.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from kvhost.caches import CacheSet, Layer, Member
from kvhost.errors import RequestError
from kvhost.layout import Layout
from kvhost.raw import raw_dtype
from kvhost.registry import get_backend
from kvhost.transform import block_ratio


def raw(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as integers of the same item size (same shape), as its device's
    backend reads them: a view on most devices, a copy on XLA (which has no byte views;
    write bytes with ``set_raw``)."""
    return get_backend(tensor.device).raw(tensor)


def set_raw(tensor: torch.Tensor, host_raw: torch.Tensor) -> None:
    """Write ``host_raw`` (integers of ``tensor``'s item size and shape) into ``tensor``'s bytes."""
    get_backend(tensor.device).write_raw(tensor, host_raw)


def make_cache(
    axes: str,
    physical: str,
    sizes: Mapping[str, int],
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """An uninitialised tensor whose dims in shape order are ``axes``, in memory ``physical``."""
    memory = torch.empty([sizes[a] for a in physical], dtype=dtype, device=device)
    return memory.permute([physical.index(a) for a in axes])


def fill_random(tensor: torch.Tensor, seed: int) -> torch.Tensor:
    """Fill every byte of ``tensor`` from ``seed``; returns the tensor."""
    generator = torch.Generator().manual_seed(seed)
    values = torch.randint(
        0, 256, (*tuple(tensor.shape), tensor.element_size()), dtype=torch.uint8, generator=generator
    )
    host = values.view(raw_dtype(tensor.dtype)).squeeze(-1)
    set_raw(tensor, host)
    return tensor


def block_letters(layout: Layout) -> str:
    """Letters of one block other than B and N, in the fixed order used for truth tensors."""
    return "".join(a for a in "LKHC" if a in layout.axes)


def read_tokens(tensor: torch.Tensor, layout: Layout, block_ids: Sequence[int]) -> torch.Tensor:
    """Raw ``[tokens, *block_letters]`` of the given blocks, read through the local layout."""
    letters = block_letters(layout)
    view = raw(tensor).permute([layout.axes.index(a) for a in "BN" + letters])
    index = torch.as_tensor(list(block_ids), dtype=torch.int64, device=tensor.device)
    picked = view.index_select(0, index).cpu()
    return picked.reshape(-1, *picked.shape[2:])


def wire_stream(truth: torch.Tensor, letters: str, remote_order: str, remote_block_size: int) -> torch.Tensor:
    """The sender's bytes for ``truth`` ``[tokens, *letters]``: its blocks back to back.

    Each sender block holds ``remote_block_size`` tokens laid out in ``remote_order``.
    """
    tokens = truth.shape[0]
    blocks = truth.reshape(tokens // remote_block_size, remote_block_size, *truth.shape[1:])
    named = "BN" + letters
    # A letter of size 1 has no place that moves a byte: the sender may name one this region
    # has not (selected out as an outer letter), or leave one out.
    given = [a for a in remote_order if a in named]
    missing = [a for a in letters if a not in given]
    assert all(blocks.shape[named.index(a)] == 1 for a in missing), (remote_order, letters)
    order = [named.index(a) for a in ["B", *given, *missing]]
    return blocks.permute(order).contiguous().reshape(-1).view(torch.uint8)


def write_wire(
    tensor: torch.Tensor,
    layout: Layout,
    block_ids: Sequence[int],
    truth: torch.Tensor,
    remote_order: str,
    remote_block_size: int,
    tokens: int | None = None,
) -> None:
    """Leave in ``block_ids``' regions what NIXL would after moving ``truth`` from the sender.

    ``truth`` is ``[tokens, *block_letters(layout)]``; outer letters select which region.
    With ``tokens``, the sender sends only the blocks that hold its first ``tokens``
    tokens (each whole): the bytes after them keep what they held.
    """
    if tokens is not None:
        truth = truth[: -(-tokens // remote_block_size) * remote_block_size]
    letters = block_letters(layout)
    host = raw(tensor).cpu() if tensor.device.type != "cpu" else raw(tensor)
    physical = layout.physical_view(host)
    outer_sizes = [layout.size(a) for a in layout.outer]
    for outer_index in _indices(outer_sizes):
        picked = truth
        kept = letters
        for letter, i in zip(layout.outer, outer_index):
            picked = picked.select(1 + kept.index(letter), i)
            kept = kept.replace(letter, "")
        stream = wire_stream(picked, kept, remote_order, remote_block_size)
        region_bytes = layout.region_bytes
        regions = physical[tuple(outer_index)]
        for j, block in enumerate(block_ids):
            part = stream[j * region_bytes : (j + 1) * region_bytes]
            if part.numel():
                region = regions[block]  # one run of bytes, whatever strides its letters of size 1 carry
                region.as_strided((region.numel(),), (1,)).view(torch.uint8)[: part.numel()].copy_(part)
    if tensor.device.type != "cpu":
        set_raw(tensor, host)


def _indices(sizes: list[int]) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = [()]
    for size in sizes:
        out = [(*prefix, i) for prefix in out for i in range(size)]
    return out


@dataclass
class Wired:
    """A request written to the wire: its ids, sender spec and, per member, the truth;
    ``tokens``: how many of its tokens the sender sent (None: all its blocks hold)."""

    block_ids: list[int]
    remote_order: str
    remote_block_size: int
    truths: dict[tuple[str, int], torch.Tensor]
    tokens: int | None = None


class ReceiveCase:
    """Caches filled with sentinel bytes, requests written as wire bytes, and the checks.

    ``send(name, ids, order, size)`` writes a request; ``check()`` asserts every request
    reads back as its truth through the local layout and every other block kept its bytes.
    A request sent with ``tokens`` must read back its first ``tokens`` tokens, and zero
    bytes for every token after them in its blocks.
    """

    def __init__(self, caches: Mapping[str, Layer], axes: str, seed: int = 0) -> None:
        self.caches = caches
        self.axes = axes
        self.set = CacheSet(caches, axes)
        self.seed = seed
        for i, member in enumerate(self.set.members):
            fill_random(member.tensor, seed * 1000 + i)
        self.before = snapshot(self.set.members)
        self.requests: dict[str, Wired] = {}

    def send(
        self,
        name: str,
        block_ids: Sequence[int],
        remote_order: str,
        remote_block_size: int,
        tokens: int | None = None,
    ) -> None:
        # A sender block spans g local blocks where it is g times larger: a request sends whole ones.
        g = block_ratio(self.set.layout.block_size, remote_block_size, RequestError)[1]
        if len(block_ids) % g:
            raise RequestError(
                f"request {name!r}: {len(block_ids)} block ids are not whole sender blocks: a sender block "
                f"of {remote_block_size} tokens spans {g} local blocks of {self.set.layout.block_size}"
            )
        truths = {}
        for i, member in enumerate(self.set.members):
            layout = member.layout
            letters = block_letters(layout)
            shape = [len(block_ids) * layout.block_size] + [layout.size(a) for a in letters]
            seed = zlib.crc32(f"{self.seed}/{name}/{i}".encode())
            truth = fill_random(torch.empty(shape, dtype=member.tensor.dtype), seed)
            truth = raw(truth)
            write_wire(member.tensor, layout, block_ids, truth, remote_order, remote_block_size, tokens)
            truths[member.layer, member.index] = truth
        self.requests[name] = Wired(list(block_ids), remote_order, remote_block_size, truths, tokens)

    def check(self) -> None:
        claimed = {b for wired in self.requests.values() for b in wired.block_ids}
        for i, member in enumerate(self.set.members):
            for name, wired in self.requests.items():
                got = read_tokens(member.tensor, member.layout, wired.block_ids)
                want = wired.truths[member.layer, member.index]
                if wired.tokens is not None:
                    want = want.clone()
                    want[wired.tokens :] = 0  # what arrived, then zero bytes
                if not torch.equal(got, want):
                    bad = (got != want).nonzero()[0].tolist()
                    raise AssertionError(
                        f"layer {member.layer!r}[{member.index}] request {name!r}: token/letters index {bad} "
                        f"is {got[tuple(bad)].item()} but the sender sent {want[tuple(bad)].item()}"
                    )
            self.check_untouched(i, claimed)

    def check_untouched(self, member_index: int, claimed: set[int]) -> None:
        member = self.set.members[member_index]
        block = first_changed_block(member, self.before[member_index], claimed)
        if block is not None:
            raise AssertionError(f"layer {member.layer!r}[{member.index}]: untouched block {block} changed")

    def snapshot(self) -> list[torch.Tensor]:
        """Every cache's bytes now, to show later that a rejected call changed nothing."""
        return snapshot(self.set.members)

    def same_as(self, snapshot: list[torch.Tensor]) -> bool:
        return all(torch.equal(raw(m.tensor).cpu(), saved) for m, saved in zip(self.set.members, snapshot))


class CopyCase:
    """Both sides of a copy read before it, and the check after it.

    ``check(src_ids, dst_ids)`` asserts that destination block ``dst_ids[i]`` reads back,
    token for token, as source block ``src_ids[i]`` read *before* the copy, and that every
    other block of both sides kept its bytes: a copy that also wrote its source would
    otherwise agree with itself. Source and destination may be one cache set (blocks apart).
    Members pair in order, as a copy pairs them (same layer names, same tuple lengths).
    """

    def __init__(self, src: Mapping[str, Layer], dst: Mapping[str, Layer], src_axes: str, dst_axes: str) -> None:
        self.src, self.dst = CacheSet(src, src_axes), CacheSet(dst, dst_axes)
        self.same = src is dst
        self.truths = [read_tokens(m.tensor, m.layout, range(m.layout.num_blocks)) for m in self.src.members]
        self.src_before, self.dst_before = snapshot(self.src.members), snapshot(self.dst.members)

    def check(self, src_ids: Sequence[int], dst_ids: Sequence[int]) -> None:
        written = set(dst_ids)
        for member, truth in zip(self.src.members, self.truths, strict=True):
            per_block = member.layout.block_size  # the truth's tokens, block after block
            destination = self.dst.layers[member.layer][member.index]
            for s, d in zip(src_ids, dst_ids, strict=True):
                want = _moving_dims(truth[s * per_block : (s + 1) * per_block])
                if not torch.equal(_moving_dims(read_tokens(destination.tensor, destination.layout, [d])), want):
                    raise AssertionError(f"{destination.name}: block {d} does not hold source block {s}")
        for members, before, kept_out in (
            (self.dst.members, self.dst_before, written),
            (self.src.members, self.src_before, written if self.same else set()),
        ):
            for member, saved in zip(members, before, strict=True):
                block = first_changed_block(member, saved, kept_out)
                if block is not None:
                    raise AssertionError(f"{member.name}: block {block}, not written by the copy, changed")


def _moving_dims(tokens: torch.Tensor) -> torch.Tensor:
    """``[tokens, *letters]`` without its letters of size 1: the two sides of a copy may
    differ by such letters (one head named on one side only), which hold no byte apart."""
    return tokens.reshape(tokens.shape[0], *(n for n in tokens.shape[1:] if n > 1))


def snapshot(members: Sequence[Member]) -> list[torch.Tensor]:
    """Each member's bytes now, on the host."""
    return [raw(m.tensor).cpu().clone() for m in members]


def first_changed_block(member: Member, saved: torch.Tensor, written: set[int]) -> int | None:
    """The first block outside ``written`` whose bytes differ from ``saved`` (a ``snapshot``
    entry of ``member``), or None."""
    b = member.layout.axes.index("B")
    now = raw(member.tensor).cpu()
    for block in range(member.layout.num_blocks):
        if block not in written and not torch.equal(now.select(b, block), saved.select(b, block)):
            return block
    return None
