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

from kvhost.caches import CacheSet, Layer, Member
from kvhost.testing import raw, read_tokens


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
    """
    source, dest = CacheSet(remote, remote_axes, role="remote"), CacheSet(local, local_axes, role="local")
    if len(source.members) != len(dest.members):
        source, dest = source.split_k(), dest.split_k()  # (K, V) tuples on one side, a K axis on the other
    if list(source.layers) != list(dest.layers):
        raise ValueError(f"remote layers {list(source.layers)} and local layers {list(dest.layers)} differ")
    for name, dest_members in dest.layers.items():
        for src, dst in zip(source.layers[name], dest_members, strict=True):
            _read_member(src, dst, list(remote_ids), list(local_ids))


def assert_same_tokens(
    local: Mapping[str, Layer],
    local_axes: str,
    local_ids: Sequence[int],
    remote: Mapping[str, Layer],
    remote_axes: str,
    remote_ids: Sequence[int],
) -> None:
    """Assert that ``local_ids`` read, through the local layout, the tokens ``remote_ids`` hold."""
    source, dest = CacheSet(remote, remote_axes, role="remote"), CacheSet(local, local_axes, role="local")
    if len(source.members) != len(dest.members):
        source, dest = source.split_k(), dest.split_k()
    for name, dest_members in dest.layers.items():
        for src, dst in zip(source.layers[name], dest_members, strict=True):
            want = read_tokens(src.tensor, src.layout, remote_ids)
            got = read_tokens(dst.tensor, dst.layout, local_ids)
            if not torch.equal(got, want):
                bad = (got != want).nonzero()[0].tolist()
                raise AssertionError(
                    f"layer {name!r}[{dst.index}], local blocks {list(local_ids)}: token/letters index {bad} "
                    f"is {got[tuple(bad)].item()} but the sender holds {want[tuple(bad)].item()}"
                )


def _read_member(src: Member, dst: Member, remote_ids: list[int], local_ids: list[int]) -> None:
    theirs, ours = src.layout, dst.layout
    sizes = {a: s for a, s in ours.logical_sizes().items() if a != "N"}
    if sizes != {a: s for a, s in theirs.logical_sizes().items() if a != "N"}:
        raise ValueError(f"layer {dst.layer!r}: local sizes {ours.logical_sizes()} != remote {theirs.logical_sizes()}")
    if len(remote_ids) * theirs.block_size != len(local_ids) * ours.block_size:
        raise ValueError(
            f"{len(remote_ids)} remote blocks of {theirs.block_size} tokens do not fill "
            f"{len(local_ids)} local blocks of {ours.block_size}"
        )
    remote_bytes, local_bytes = raw(src.tensor).cpu(), raw(dst.tensor)
    if remote_bytes.element_size() != local_bytes.element_size():
        raise ValueError(f"layer {dst.layer!r}: remote and local item sizes differ")
    region = ours.region_numel
    for index in itertools.product(*(range(ours.size(a)) for a in ours.outer)):
        theirs_at, their_letters = _select(remote_bytes, theirs.axes, ours.outer, index)
        ours_at, our_letters = _select(local_bytes, ours.axes, ours.outer, index)
        shares = [_in_memory_order(theirs_at.select(their_letters.index("B"), b)).reshape(-1) for b in remote_ids]
        stream = torch.cat(shares)
        for j, block in enumerate(local_ids):
            target = _in_memory_order(ours_at.select(our_letters.index("B"), block))
            if not target.is_contiguous():
                raise ValueError(f"layer {dst.layer!r}: local block {block} at {index} is not one run of bytes")
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
