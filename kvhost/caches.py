"""A validated layer dict: every tensor of every layer, with its Layout and one device.

A layer is a tensor, or a tuple of tensors (K and V kept apart, as Gaudi and others do).
For a tuple, ``axes`` names each member's dims; when ``axes`` has a ``K`` that the members
lack, the tuple index stands for ``K``, so ``axes="KBNHC"`` describes both a
``[2, B, N, H, C]`` tensor and a pair of ``[B, N, H, C]`` tensors.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from kvhost.errors import KVHostError, LayoutError
from kvhost.layout import Layout
from kvhost.transform import CopyPlan, plan_copy

Layer = torch.Tensor | tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class Member:
    """One tensor of one layer: ``index`` is its place in the layer's tuple (0 for a tensor)."""

    layer: str
    index: int
    tensor: torch.Tensor
    layout: Layout

    @cached_property
    def address(self) -> int:
        """The tensor's data address when the set was read (host kernels work on addresses)."""
        return int(self.tensor.data_ptr())


class MemberList(list[Member]):
    """Members that a backend handles together; their data addresses are read once.

    Backends that work on raw memory (the CPU kernels) take base addresses from here
    instead of asking every tensor on every call.
    """

    @cached_property
    def addresses(self) -> np.ndarray:
        return np.fromiter((m.address for m in self), dtype=np.int64, count=len(self))


class CacheSet:
    """Layers by name, validated: one device, every member the same shape and letters."""

    def __init__(self, caches: Mapping[str, Layer], axes: str, *, role: str = "caches") -> None:
        if not caches:
            raise LayoutError(f"{role}: no layers given")
        self.role = role
        self.axes = axes
        self.layers: dict[str, tuple[Member, ...]] = {}
        for name, layer in caches.items():
            if isinstance(layer, torch.Tensor):
                tensors: tuple[torch.Tensor, ...] = (layer,)
                member_axes = axes
            elif isinstance(layer, (tuple, list)) and layer and all(isinstance(t, torch.Tensor) for t in layer):
                tensors = tuple(layer)
                member_axes = _tuple_member_axes(axes, tensors)
            else:
                raise LayoutError(f"{role}: layer {name!r} must be a tensor or a tuple of tensors")
            self.layers[name] = tuple(
                Member(name, i, t, _layout(t, member_axes, role, name, i)) for i, t in enumerate(tensors)
            )
        self.members: list[Member] = [m for ms in self.layers.values() for m in ms]
        first = self.members[0]
        first_device = first.tensor.device
        for member in self.members[1:]:
            layout = member.layout
            if layout is not first.layout and (layout.shape != first.layout.shape or layout.axes != first.layout.axes):
                raise LayoutError(
                    f"{role}: layer {member.layer!r} has shape {layout.shape} ({layout.axes}) but layer "
                    f"{first.layer!r} has {first.layout.shape} ({first.layout.axes}); all layers must match"
                )
            if layout.itemsize != first.layout.itemsize:
                raise LayoutError(
                    f"{role}: layer {member.layer!r} has dtype {member.tensor.dtype} but layer "
                    f"{first.layer!r} has {first.tensor.dtype}; item sizes must match"
                )
            if member.tensor.device != first_device:
                raise LayoutError(
                    f"{role}: layer {member.layer!r} is on {member.tensor.device} but layer "
                    f"{first.layer!r} is on {first_device}; one call serves one device"
                )
        self.device: torch.device = first_device
        self.member_axes = first.layout.axes
        self.layout = first.layout
        self._by_layout: list[tuple[Layout, MemberList]] | None = None
        self._copy_groups: dict[int, tuple[CacheSet, list[CopyGroup]]] = {}

    def describes(self, caches: Mapping[str, Layer]) -> bool:
        """True while ``caches`` holds the very tensors this set was built from, in place."""
        if caches.keys() != self.layers.keys():
            return False
        for name, layer in caches.items():
            members = self.layers[name]
            tensors = layer if isinstance(layer, (tuple, list)) else (layer,)
            if len(tensors) != len(members) or any(
                t is not m.tensor or t.data_ptr() != m.address for t, m in zip(tensors, members)
            ):
                return False
        return True

    @property
    def num_blocks(self) -> int:
        return self.layout.num_blocks

    def by_layout(self) -> list[tuple[Layout, MemberList]]:
        """Members grouped by layout (layers may differ in strides), in first-seen order."""
        if self._by_layout is None:
            groups: dict[Layout, MemberList] = {}
            for member in self.members:
                groups.setdefault(member.layout, MemberList()).append(member)
            self._by_layout = list(groups.items())
        return self._by_layout

    def copy_groups(self, dst: CacheSet) -> list[CopyGroup]:
        """Every member paired with its counterpart in ``dst``, grouped by the copy plan.

        Checked once per pair of sets (names, member counts, dtypes, letters) and kept, so
        a connector copying between the same caches every step pays for it once.
        """
        known = self._copy_groups.get(id(dst))
        if known is not None and known[0] is dst:
            return known[1]
        if self.layers.keys() != dst.layers.keys():
            only_src = sorted(set(self.layers) - set(dst.layers))
            only_dst = sorted(set(dst.layers) - set(self.layers))
            raise LayoutError(f"layer names differ: only in src {only_src}, only in dst {only_dst}")
        src, dest = (self, dst) if len(self.members) == len(dst.members) else (self.split_k(), dst.split_k())
        groups: dict[tuple[Layout, Layout], CopyGroup] = {}
        for name, src_members in src.layers.items():
            dst_members = dest.layers[name]
            if len(src_members) != len(dst_members):
                raise LayoutError(
                    f"layer {name!r}: {len(src_members)} source tensors but {len(dst_members)} destination tensors"
                )
            for s, d in zip(src_members, dst_members):
                _check_dtypes(name, s.tensor.dtype, d.tensor.dtype)
                key = (s.layout, d.layout)
                if key not in groups:
                    try:
                        groups[key] = CopyGroup(plan_copy(s.layout, d.layout), [])
                    except KVHostError as err:
                        raise LayoutError(f"layer {name!r}: {err}") from None
                groups[key].pairs.append((s, d))
        result = list(groups.values())
        if len(self._copy_groups) >= 4:
            self._copy_groups.pop(next(iter(self._copy_groups)))
        self._copy_groups[id(dst)] = (dst, result)
        return result

    def split_k(self) -> CacheSet:
        """The same memory with ``K`` turned into tuple members (views, no copy)."""
        if "K" not in self.member_axes:
            return self
        k_dim = self.member_axes.index("K")
        split = {
            name: tuple(t for m in members for t in m.tensor.unbind(k_dim)) for name, members in self.layers.items()
        }
        return CacheSet(split, self.member_axes, role=self.role)


@dataclass
class CopyGroup:
    """Source and destination members that share one copy plan."""

    plan: CopyPlan
    pairs: list[tuple[Member, Member]]

    @cached_property
    def shares_memory(self) -> bool:
        """Whether some pair reads and writes one storage (a copy within one cache)."""
        return any(s.tensor.device == d.tensor.device for s, d in self.pairs)

    @cached_property
    def sources(self) -> MemberList:
        return MemberList(s for s, _ in self.pairs)

    @cached_property
    def destinations(self) -> MemberList:
        return MemberList(d for _, d in self.pairs)


def _check_dtypes(layer: str, src: torch.dtype, dst: torch.dtype) -> None:
    raw = (torch.uint8, torch.int8)
    if src != dst and not (src.itemsize == dst.itemsize and (src in raw or dst in raw)):
        raise LayoutError(f"layer {layer!r}: source dtype {src} != destination dtype {dst}")


def _layout(tensor: torch.Tensor, axes: str, role: str, layer: str, index: int) -> Layout:
    known = Layout.known(tensor, axes)
    return known if known is not None else Layout.of(tensor, axes, name=f"{role} layer {layer!r}[{index}]")


def _tuple_member_axes(axes: str, tensors: tuple[torch.Tensor, ...]) -> str:
    """A tuple's index stands for K when the call's axes have a K the members lack."""
    if "K" in axes and all(t.dim() == len(axes) - 1 for t in tensors):
        return axes.replace("K", "")
    return axes
