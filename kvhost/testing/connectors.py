"""Checks for connectors: what a NIXL read leaves behind, between two real caches.

A connector's test builds the sender's caches in the sender's layout and block size and
the receiver's in its own, moves the bytes with ``nixl_read`` as NIXL moves them, runs
the post-process, and compares tokens with ``assert_same_tokens``. The sender's byte
order comes from its tensors' strides, never from a layout name, so the check does not
share the name translation it tests.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

import torch

from kvhost.caches import CacheSet, Layer, Member, tuple_member_axes
from kvhost.layout import Layout
from kvhost.testing.oracle import raw, read_tokens


def nixl_read(
    remote: Mapping[str, Layer],
    remote_axes: str,
    remote_ids: Sequence[int],
    local: Mapping[str, Layer],
    local_axes: str,
    local_ids: Sequence[int],
) -> None:
    """Fill ``local_ids``' block regions with what NIXL reads from ``remote_ids``.

    For every layer and every local outer index (``K`` of a FlashAttention cache, ``H`` of
    an ``LHBNC`` one), each sender block's share is taken in the sender's memory order, the
    shares are streamed in token order, and the stream fills the local regions in block
    order: r sender blocks per local region, or one sender block over g local regions.
    The sender's share may be several runs of its memory (a ``BHLNC`` layer view's heads).
    """
    for name, theirs, ours in _pairs(remote, remote_axes, local, local_axes):
        _read_member(name, theirs, ours, list(remote_ids), list(local_ids))


def assert_same_tokens(
    local: Mapping[str, Layer],
    local_axes: str,
    local_ids: Sequence[int],
    remote: Mapping[str, Layer],
    remote_axes: str,
    remote_ids: Sequence[int],
) -> None:
    """Assert that ``local_ids`` read, through the local layout, the tokens ``remote_ids`` hold."""
    for name, theirs, ours in _pairs(remote, remote_axes, local, local_axes):
        want = read_tokens(theirs.tensor, theirs.layout, remote_ids)
        got = read_tokens(ours.tensor, ours.layout, local_ids)
        if not torch.equal(got, want):
            bad = (got != want).nonzero()[0].tolist()
            raise AssertionError(
                f"layer {name!r}[{ours.index}], local blocks {list(local_ids)}: token/letters index {bad} "
                f"is {got[tuple(bad)].item()} but the sender holds {want[tuple(bad)].item()}"
            )


def _pairs(
    remote: Mapping[str, Layer], remote_axes: str, local: Mapping[str, Layer], local_axes: str
) -> list[tuple[str, Member, Member]]:
    """(layer, sender tensor, local tensor) pairs; the sender's layout is read, not validated.

    A sender's block share need not be one run of bytes, so its tensors skip kvhost's
    region checks; local tensors get them all.
    """
    dest = CacheSet(local, local_axes, role="local")
    if set(remote) != set(dest.layers):
        raise ValueError(f"remote layers {list(remote)} and local layers {list(dest.layers)} differ")
    source = {name: _unchecked_members(name, layer, remote_axes) for name, layer in remote.items()}
    split = any(len(source[name]) != len(members) for name, members in dest.layers.items())
    if split:  # (K, V) tuples on one side, a K axis on the other: look at K as tuple members
        dest = dest.split_k()
        source = {name: [m for member in members for m in _split_k(member)] for name, members in source.items()}
    return [
        (name, theirs, ours)
        for name, members in dest.layers.items()
        for theirs, ours in zip(source[name], members, strict=True)
    ]


def _unchecked_members(name: str, layer: Layer, axes: str) -> list[Member]:
    tensors = tuple(layer) if isinstance(layer, tuple | list) else (layer,)
    member_axes = tuple_member_axes(axes, tensors) if isinstance(layer, tuple | list) else axes
    return [Member(name, i, t, _layout(t, member_axes)) for i, t in enumerate(tensors)]


def _split_k(member: Member) -> list[Member]:
    axes = member.layout.axes
    if "K" not in axes:
        return [member]
    parts = member.tensor.unbind(axes.index("K"))
    return [Member(member.layer, i, t, _layout(t, axes.replace("K", ""))) for i, t in enumerate(parts)]


def _layout(tensor: torch.Tensor, axes: str) -> Layout:
    if tensor.dim() != len(axes):
        raise ValueError(f"axes {axes!r} name {len(axes)} dims but the tensor has {tensor.dim()}")
    shape, strides = tuple(tensor.shape), tuple(tensor.stride())
    return Layout(axes, shape, strides, tensor.element_size(), name="sender", regions_checked=False)


def _read_member(name: str, src: Member, dst: Member, remote_ids: list[int], local_ids: list[int]) -> None:
    theirs, ours = src.layout, dst.layout
    sizes = {a: s for a, s in ours.logical_sizes().items() if a != "N"}
    if sizes != {a: s for a, s in theirs.logical_sizes().items() if a != "N"}:
        raise ValueError(f"layer {name!r}: local sizes {ours.logical_sizes()} != remote {theirs.logical_sizes()}")
    if len(remote_ids) * theirs.block_size != len(local_ids) * ours.block_size:
        raise ValueError(
            f"{len(remote_ids)} remote blocks of {theirs.block_size} tokens do not fill "
            f"{len(local_ids)} local blocks of {ours.block_size}"
        )
    remote_bytes, local_bytes = raw(src.tensor).cpu(), raw(dst.tensor)
    if remote_bytes.element_size() != local_bytes.element_size():
        raise ValueError(f"layer {name!r}: remote and local item sizes differ")
    region = ours.region_numel
    for index in itertools.product(*(range(ours.size(a)) for a in ours.outer)):
        theirs_at, their_letters = _select(remote_bytes, theirs.axes, ours.outer, index)
        ours_at, our_letters = _select(local_bytes, ours.axes, ours.outer, index)
        shares = [_in_memory_order(theirs_at.select(their_letters.index("B"), b)).reshape(-1) for b in remote_ids]
        stream = torch.cat(shares)
        for j, block in enumerate(local_ids):
            target = _in_memory_order(ours_at.select(our_letters.index("B"), block))
            if not target.is_contiguous():
                raise ValueError(f"layer {name!r}: local block {block} at {index} is not one run of bytes")
            target.view(-1).copy_(stream[j * region : (j + 1) * region].to(target.device))


def _select(tensor: torch.Tensor, axes: str, letters: str, index: tuple[int, ...]) -> tuple[torch.Tensor, str]:
    """``tensor`` at ``index`` of ``letters``, and the letters of the dims left."""
    for letter, i in zip(letters, index, strict=True):
        tensor = tensor.select(axes.index(letter), i)
        axes = axes.replace(letter, "")
    return tensor, axes


def _in_memory_order(tensor: torch.Tensor) -> torch.Tensor:
    """The same elements with dims in decreasing stride: the order they sit in memory."""
    strides, shape = tensor.stride(), tensor.shape
    order = sorted(range(tensor.dim()), key=lambda d: (-strides[d], shape[d] == 1, d))
    return tensor.permute(order)
