"""A validated layer dict: every tensor of every layer, with its Layout and one device.

A layer is a tensor, or a tuple of tensors (K and V kept apart, as Gaudi and others do).
For a tuple, ``axes`` names each member's dims; when ``axes`` has a ``K`` that the members
lack, the tuple index stands for ``K``, so ``axes="KBNHC"`` describes both a
``[2, B, N, H, C]`` tensor and a pair of ``[B, N, H, C]`` tensors.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from kvhost.errors import LayoutError
from kvhost.layout import Layout

Layer = torch.Tensor | tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class Member:
    """One tensor of one layer: ``index`` is its place in the layer's tuple (0 for a tensor)."""

    layer: str
    index: int
    tensor: torch.Tensor
    layout: Layout


class CacheSet:
    """Layers by name, validated: one device, every member the same shape and letters."""

    def __init__(self, caches: Mapping[str, Layer], axes: str, *, role: str = "caches") -> None:
        if not caches:
            raise LayoutError(f"{role}: no layers given")
        self.role = role
        self.axes = axes
        self.layers: dict[str, tuple[Member, ...]] = {}
        for name, layer in caches.items():
            tensors = layer if isinstance(layer, (tuple, list)) else (layer,)
            if not tensors or not all(isinstance(t, torch.Tensor) for t in tensors):
                raise LayoutError(f"{role}: layer {name!r} must be a tensor or a tuple of tensors")
            member_axes = _member_axes(axes, tensors, isinstance(layer, (tuple, list)))
            self.layers[name] = tuple(
                Member(name, i, t, Layout.of(t, member_axes, name=f"{role} layer {name!r}[{i}]"))
                for i, t in enumerate(tensors)
            )
        self.members: list[Member] = [m for ms in self.layers.values() for m in ms]
        first = self.members[0]
        for member in self.members[1:]:
            if member.tensor.shape != first.tensor.shape or member.layout.axes != first.layout.axes:
                raise LayoutError(
                    f"{role}: layer {member.layer!r} has shape {tuple(member.tensor.shape)} "
                    f"({member.layout.axes}) but layer {first.layer!r} has "
                    f"{tuple(first.tensor.shape)} ({first.layout.axes}); all layers must match"
                )
            if member.tensor.device != first.tensor.device:
                raise LayoutError(
                    f"{role}: layer {member.layer!r} is on {member.tensor.device} but layer "
                    f"{first.layer!r} is on {first.tensor.device}; one call serves one device"
                )
            if member.tensor.dtype.itemsize != first.tensor.dtype.itemsize:
                raise LayoutError(
                    f"{role}: layer {member.layer!r} has dtype {member.tensor.dtype} but layer "
                    f"{first.layer!r} has {first.tensor.dtype}; item sizes must match"
                )
        self.device: torch.device = first.tensor.device
        self.member_axes = first.layout.axes
        self.layout = first.layout
        self._by_layout: list[tuple[Layout, list[Member]]] | None = None

    @property
    def num_blocks(self) -> int:
        return self.layout.num_blocks

    def by_layout(self) -> list[tuple[Layout, list[Member]]]:
        """Members grouped by layout (layers may differ in strides), in first-seen order."""
        if self._by_layout is None:
            groups: dict[Layout, list[Member]] = {}
            for member in self.members:
                groups.setdefault(member.layout, []).append(member)
            self._by_layout = list(groups.items())
        return self._by_layout

    def split_k(self) -> CacheSet:
        """The same memory with ``K`` turned into tuple members (views, no copy)."""
        if "K" not in self.member_axes:
            return self
        k_dim = self.member_axes.index("K")
        split = {
            name: tuple(t for m in members for t in m.tensor.unbind(k_dim)) for name, members in self.layers.items()
        }
        return CacheSet(split, self.member_axes, role=self.role)


def _member_axes(axes: str, tensors: tuple[torch.Tensor, ...] | list[torch.Tensor], is_tuple: bool) -> str:
    if is_tuple and "K" in axes and all(t.dim() == len(axes) - 1 for t in tensors):
        return axes.replace("K", "")
    return axes
