"""The per-request path engines run today, written here as the bench's baseline.

Receive: per request, per layer tensor, per outer index (the K/V half of a ``KBNHC``
cache), gather the request's blocks, rearrange them with a reshape/permute copy, and
scatter them back: three passes over the bytes and one index tensor per request.
Staging: per request, per layer tensor, per outer index, index then assign.

It is a correct implementation (the bench and the tests check it against kvhost and
against the conformance oracle), only slow. Its rearrangement is derived here from the
letters, on its own, not through ``kvhost.transform``, so the two check each other.
Only layout facts (physical order, region) come from ``kvhost.layout``; an engine keeps
those per cache as well.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvhost.batch import Incoming
from kvhost.caches import CacheSet, Layer, Member
from kvhost.errors import RequestError
from kvhost.raw import as_raw

Ids = Sequence[int] | np.ndarray


@dataclass(frozen=True)
class WireView:
    """How a gathered request's wire bytes turn into local bytes.

    ``gathered.view(-1, *wire_shape).permute(0, *[1 + p for p in perm])`` has the local
    region's shape once its middle dims are merged: one batched reshape/permute copy.
    """

    wire_shape: tuple[int, ...]
    perm: tuple[int, ...]
    parts: int  # local blocks per sender block: g, or 1 when the local block is r >= 1 senders


def wire_view(region: str, sizes: Mapping[str, int], remote_order: str, remote_block_size: int) -> WireView:
    """The wire-to-local rearrangement of a block region, named letter by letter.

    The token axis splits into ``P`` (which sub-block or part) and ``n`` (tokens of the
    smaller block): with local = r x remote a local region holds ``[P, remote order(n)]``
    and wants ``region(P n)``; with remote = g x local a group of g regions holds
    ``remote order(P n)`` and wants ``[P, region(n)]``.
    """
    if sorted(remote_order) != sorted(region):
        raise RequestError(f"remote order {remote_order!r} does not use the letters of the local region {region!r}")
    local_size = sizes["N"]
    if remote_block_size > 0 and local_size % remote_block_size == 0:
        parts, split, tokens = 1, local_size // remote_block_size, remote_block_size
    elif remote_block_size > 0 and remote_block_size % local_size == 0:
        parts = split = remote_block_size // local_size
        tokens = local_size
    else:
        raise RequestError(f"remote block size {remote_block_size} does not divide or multiply local {local_size}")
    named = {a: sizes[a] for a in region if a != "N"} | {"P": split, "n": tokens}

    def expand(order: str, token_axes: str) -> list[str]:
        return [x for a in order for x in (token_axes if a == "N" else a)]

    if parts == 1:
        wire, local = ["P", *expand(remote_order, "n")], expand(region, "Pn")
    else:
        wire, local = expand(remote_order, "Pn"), ["P", *expand(region, "n")]
    return WireView(tuple(named[a] for a in wire), tuple(wire.index(a) for a in local), parts)


class PerRequestReceiver:
    """Receive one request, one layer, one K/V half at a time: gather -> permute -> scatter.

    Built once per set of caches (engines keep their layout facts too), so the bench
    times only the per-call work.
    """

    def __init__(self, caches: Mapping[str, Layer], axes: str) -> None:
        self.caches = CacheSet(caches, axes)

    def receive(
        self,
        requests: Mapping[str, Ids | Incoming],
        *,
        remote_order: str | None = None,
        remote_block_size: int | None = None,
    ) -> int:
        """Post-process every request in place; returns the bytes rewritten."""
        moved = 0
        for request in requests.values():
            ids = request.block_ids if isinstance(request, Incoming) else request
            order = getattr(request, "remote_order", None) or remote_order
            size = getattr(request, "remote_block_size", None) or remote_block_size
            if len(ids) == 0:
                continue
            # One index tensor per request, as an engine makes it, shared by every layer.
            index = torch.tensor(list(ids), dtype=torch.int64, device=self.caches.device)
            for member in self.caches.members:
                moved += _receive_member(member, index, order, size)
        return moved


def _receive_member(
    member: Member, index: torch.Tensor, remote_order: str | None, remote_block_size: int | None
) -> int:
    layout = member.layout
    region = layout.region
    sizes = {a: layout.size(a) for a in region}
    view = wire_view(region, sizes, remote_order or region, remote_block_size or layout.block_size)
    physical = layout.physical_view(as_raw(member.tensor))
    region_shape = [sizes[a] for a in region]
    outer = [range(layout.size(a)) for a in layout.outer]
    for outer_index in itertools.product(*outer):
        blocks = physical[outer_index]  # [B, *region]
        gathered = blocks.index_select(0, index)
        wire = gathered.view(-1, *view.wire_shape)
        local = wire.permute(0, *[1 + p for p in view.perm]).reshape(len(index), *region_shape)
        blocks.index_copy_(0, index, local)
    return len(index) * layout.outer_count * layout.region_bytes


class PerRequestStager:
    """Staging copies one request and one layer at a time, K and V together where K is a dim:
    index, then assign, as vLLM's host-buffer path does (``dst[:, ids] = src[:, ids]``).

    ``src`` and ``dst`` are layer dicts with the same names (the device cache and a host
    buffer, either way); ``dst_axes`` names dst's dims when its layout differs.
    """

    def __init__(
        self, src: Mapping[str, Layer], dst: Mapping[str, Layer], *, axes: str, dst_axes: str | None = None
    ) -> None:
        source = CacheSet(src, axes, role="src")
        dest = CacheSet(dst, dst_axes or axes, role="dst")
        if len(source.members) != len(dest.members):
            source, dest = source.split_k(), dest.split_k()
        self.pairs = [(s, d) for name in source.layers for s, d in zip(source.layers[name], dest.layers[name])]

    def copy(self, requests: Sequence[tuple[Ids, Ids]]) -> int:
        """For each request ``(src_ids, dst_ids)``: copy its blocks; returns the bytes copied."""
        moved = 0
        for src_ids, dst_ids in requests:
            if len(src_ids) == 0:
                continue
            # One pair of index tensors per request, as an engine makes them, for every layer.
            src_index = torch.tensor(list(src_ids), dtype=torch.int64, device=self.pairs[0][0].tensor.device)
            dst_index = torch.tensor(list(dst_ids), dtype=torch.int64, device=self.pairs[0][1].tensor.device)
            for src, dst in self.pairs:
                moved += _stage_member(src, dst, src_index, dst_index)
        return moved


def _stage_member(src: Member, dst: Member, src_index: torch.Tensor, dst_index: torch.Tensor) -> int:
    # Both sides seen in src's shape order; one index-and-assign along B takes every other
    # letter with it (K and V together, where K is a dim).
    dest = as_raw(dst.tensor).permute([dst.layout.axes.index(a) for a in src.layout.axes])
    b = src.layout.axes.index("B")
    dest[(slice(None),) * b + (dst_index,)] = as_raw(src.tensor)[(slice(None),) * b + (src_index,)].to(dest.device)
    return len(src_index) * src.layout.region_numel * src.layout.outer_count * src.layout.itemsize
