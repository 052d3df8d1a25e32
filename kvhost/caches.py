"""A validated layer dict: every tensor of every layer, with its Layout and one device.

A layer is a tensor, or a tuple of tensors (K and V kept apart, as Gaudi and others do).
For a tuple, ``axes`` names each member's dims; when ``axes`` has a ``K`` that the members
lack, the tuple index stands for ``K``, so ``axes="KBNHC"`` describes both a
``[2, B, N, H, C]`` tensor and a pair of ``[B, N, H, C]`` tensors.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from operator import attrgetter, is_

import numpy as np
import torch

from kvhost.errors import KVHostError, LayoutError, RequestError, shown, shown_name
from kvhost.layout import Layout
from kvhost.lru import LRU
from kvhost.memory import find_overlap
from kvhost.transform import CopyPlan, Rearrangement, plan_copy, plan_receive

Layer = torch.Tensor | tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class Member:
    """One tensor of one layer: ``index`` is its place in the layer's tuple (0 for a tensor).

    ``address`` is the tensor's data address when the set was read (kernels work on
    addresses); 0 for tensors whose storage has no memory a host can address (XLA, meta).
    """

    layer: str
    index: int
    tensor: torch.Tensor
    layout: Layout
    address: int
    data_ptr: int = field(repr=False)  # as torch reports it, to see it change
    # The storage itself, held: memory a re-pointed tensor (``set_``) let go of stays ours,
    # so no other storage can come to lie at its address; its size shows a resize in place.
    storage: torch.UntypedStorage = field(repr=False)
    storage_bytes: int = field(repr=False)

    def __init__(self, layer: str, index: int, tensor: torch.Tensor, layout: Layout) -> None:
        # Written here (a dataclass makes no __init__ where the class has one), not by a
        # generated __init__ and a __post_init__: a one-off call makes one Member per
        # tensor, and frozen fields set one by one cost a microsecond.
        storage = tensor.untyped_storage()
        pointer = tensor.data_ptr()
        self.__dict__.update(
            layer=layer,
            index=index,
            tensor=tensor,
            layout=layout,
            address=pointer if _has_address(storage) else 0,
            data_ptr=pointer,
            storage=storage,
            storage_bytes=storage.nbytes(),
        )

    @property
    def name(self) -> str:
        return f"layer {shown_name(self.layer)}[{self.index}]"

    def check_backed(self, role: str) -> None:
        """Raise unless the tensor's storage holds every byte its view spans: a freed or shrunk
        storage would have kernels write past its end."""
        needed = self.tensor.storage_offset() * self.layout.itemsize + self.layout.extent_bytes
        held = self.storage_bytes
        if held < needed:
            raise LayoutError(
                f"{role}: {self.name}: its storage holds {held} bytes but the tensor spans {needed}: freed or shrunk"
            )

    def is_current(self) -> bool:
        """Whether the tensor is still where, and what, it was when read: same memory, shape,
        strides, and a storage of the same size.

        ``set_``, a growing ``resize_`` and a freed storage all move the data address; a
        shrinking ``resize_`` or ``as_strided_`` changes the shape or strides; a storage
        freed and made again smaller at the same address (``resize_(0)``, then a smaller
        size) changes only its size.
        """
        tensor = self.tensor
        return (
            tensor.data_ptr() == self.data_ptr
            and tensor.shape == self.layout.shape
            and tensor.stride() == self.layout.strides
            and self.storage.nbytes() == self.storage_bytes
        )


_shape = attrgetter("shape")


def _has_address(storage: torch.UntypedStorage) -> bool:
    """Whether a storage is memory with an address (not so for meta storages, or XLA's,
    which refuse to give one)."""
    try:
        return bool(storage.data_ptr())
    except RuntimeError:
        return False


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

    def __init__(
        self, caches: Mapping[str, Layer], axes: str, *, role: str = "caches", own_slices: bool = False
    ) -> None:
        if not isinstance(caches, Mapping):
            raise LayoutError(f"{role}: expected a mapping of layer name to tensor, got {type(caches).__name__}")
        if not caches:
            raise LayoutError(f"{role}: no layers given")
        if not isinstance(axes, str):
            raise LayoutError(f"{role}: axes must be a string of axis letters, got {shown(axes)}")
        axes = str.__str__(axes)  # its own characters: a subclass's hash and == key the known layouts
        self.role = role
        self.axes = axes
        self.layers: dict[str, tuple[Member, ...]] = {}
        last: Layout | None = None
        for name, layer in caches.items():
            if not isinstance(name, str):
                raise LayoutError(f"{role}: layer names must be strings, got {shown(name)}")
            if isinstance(layer, torch.Tensor):
                tensors: tuple[torch.Tensor, ...] = (layer,)
                member_axes = axes
            elif isinstance(layer, (tuple, list)) and layer and all(isinstance(t, torch.Tensor) for t in layer):
                tensors = tuple(layer)
                member_axes = tuple_member_axes(axes, tensors)
            else:
                what = f"{role}: layer {shown_name(name)}"
                raise LayoutError(f"{what} must be a tensor or a tuple of tensors, got {_not_tensors(layer)}")
            members = []
            for i, tensor in enumerate(tensors):
                # A cache's layers mostly share one layout: the last one read is tried first.
                if last is None or not last.describes(tensor, member_axes):
                    last = _layout(tensor, member_axes, role, name, i)
                member = Member(name, i, tensor, last)
                member.check_backed(role)
                members.append(member)
            self.layers[name] = tuple(members)
        self.members: list[Member] = [m for ms in self.layers.values() for m in ms]
        first = self.members[0]
        first_device = first.tensor.device
        for member in self.members[1:]:
            layout = member.layout
            if layout is not first.layout and (layout.shape != first.layout.shape or layout.axes != first.layout.axes):
                # A layer's K and V of two shapes (another head dim for V, say) are two sets
                # of caches to the planner: one call each.
                same_layer = member.layer == first.layer
                hint = "; members of two shapes (K and V of two head dims) go in two calls" if same_layer else ""
                raise LayoutError(
                    f"{role}: {member.name} has shape {layout.shape} ({layout.axes}) but "
                    f"{first.name} has {first.layout.shape} ({first.layout.axes}); all layers must match{hint}"
                )
            if layout.itemsize != first.layout.itemsize:
                raise LayoutError(
                    f"{role}: {member.name} has dtype {member.tensor.dtype} but "
                    f"{first.name} has {first.tensor.dtype}; item sizes must match"
                )
            if member.tensor.device != first_device:
                raise _devices_differ(role, member.layer, member.tensor.device, first.layer, first_device)
        self.device: torch.device = first_device
        self.member_axes = first.layout.axes
        self.layout = first.layout
        self._by_layout: list[tuple[Layout, MemberList]] | None = None
        self._copy_groups: LRU[int, tuple[CacheSet, CopyGroups]] = LRU(4)
        self._receive_groups: LRU[tuple[str | None, int], tuple[ReceiveGroup, ...]] = LRU(16)
        check_owned_once(self.members, role, own_slices=own_slices)
        self._tensors = tuple(m.tensor for m in self.members)
        self._data_ptrs = tuple(m.data_ptr for m in self.members)
        self._shapes = tuple(m.layout.shape for m in self.members)
        self._strides = tuple(m.layout.strides for m in self.members)
        self._storages = tuple(m.storage for m in self.members)
        self._storage_bytes = tuple(m.storage_bytes for m in self.members)
        # The layer objects as given, to know them again by identity; not when a layer is a
        # list, whose tensors could be swapped while the list stays the same object.
        values = tuple(caches.values())
        self._values = values if all(isinstance(v, (torch.Tensor, tuple)) for v in values) else None
        self._names = tuple(caches)  # with the values: the same objects under other names are other caches

    @property
    def tuple_is_k(self) -> bool:
        """Whether the layers are tuples whose index stands for ``K`` (``axes`` has a K the
        members lack)."""
        return "K" in self.axes and "K" not in self.member_axes

    def describes(self, caches: Mapping[str, Layer]) -> bool:
        """True while ``caches`` holds the very tensors this set was built from, unchanged."""
        if type(caches) is not dict and not isinstance(caches, Mapping):  # a dict skips the ABC's slower check
            return False
        if caches.keys() != self.layers.keys():
            return False
        known, values = self._values, tuple(caches.values())
        if (
            known is not None
            and len(values) == len(known)
            and all(map(is_, values, known))
            and tuple(caches) == self._names
        ):
            # The very layer objects (tensors, tuples) as given, each under its name: only whether they moved.
            return self._unchanged()
        for name, layer in caches.items():
            members = self.layers[name]
            tensors = layer if isinstance(layer, (tuple, list)) else (layer,)
            if len(tensors) != len(members) or any(
                t is not m.tensor or not m.is_current() for t, m in zip(tensors, members)
            ):
                return False
        return True

    def check_current(self) -> None:
        """Raise unless every tensor is still where, and what, it was when the set was read.

        A registered cache that was re-pointed (``set_``), grown (``resize_``) or freed
        would otherwise be written at its old address, and one freed and made again smaller
        at the same address past its end. Four passes at C speed (about 0.2 us per tensor
        each here); the slow path only words the error.
        """
        if self._unchanged():
            return
        for member in self.members:
            if not member.is_current():
                tensor = member.tensor
                raise LayoutError(
                    f"{self.role}: {member.name} changed since it was registered (address "
                    f"{member.data_ptr:#x} -> {tensor.data_ptr():#x}, shape {member.layout.shape} -> "
                    f"{tuple(tensor.shape)}, strides {member.layout.strides} -> {tuple(tensor.stride())}, "
                    f"storage bytes {member.storage_bytes} -> {member.storage.nbytes()}): register the caches again"
                )

    def _unchanged(self) -> bool:
        """Every tensor where, and what, it was: four passes at C speed."""
        tensors = self._tensors
        return (
            tuple(map(torch.Tensor.data_ptr, tensors)) == self._data_ptrs
            and tuple(map(_shape, tensors)) == self._shapes
            and tuple(map(torch.Tensor.stride, tensors)) == self._strides
            and tuple(map(torch.UntypedStorage.nbytes, self._storages)) == self._storage_bytes
        )

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

    def receive_groups(self, remote_order: str | None, remote_block_size: int) -> tuple[ReceiveGroup, ...]:
        """The layouts that a sender's region order and block size leave work in, each with
        its rearrangement; none when the transform is the identity everywhere. A
        ``remote_order`` of None is each layout's own: a sender laid out like these caches,
        whose layers may differ in strides (the first layer's order would rewrite the others).

        Planned once per transform and kept (a few transforms: a peer can name many), so a
        connector receiving from the same sender every step plans once. The planner
        raises for letters or sizes it cannot serve, and nothing is kept then.
        """
        key = (remote_order, remote_block_size)
        groups = self._receive_groups.get(key)
        if groups is None:
            planned = (
                (layout, members, self._plan_receive(layout, members, remote_order, remote_block_size))
                for layout, members in self.by_layout()
            )
            groups = self._receive_groups.put(
                key, tuple(ReceiveGroup(members, layout, plan) for layout, members, plan in planned if plan)
            )
        return groups

    def _plan_receive(
        self, layout: Layout, members: MemberList, remote_order: str | None, remote_block_size: int
    ) -> Rearrangement | None:
        try:
            if remote_order is None and layout.block_size == 1 != remote_block_size and _holds_more(layout):
                # Where a token axis of size 1 sits here is its stride's accident (two
                # contiguous tensors of one shape may differ in it); the sender's is not.
                raise RequestError(
                    f"blocks of one token here ({layout.region!r} by their strides) do not say where the "
                    f"sender's tokens sit in its blocks of {remote_block_size}: give its remote_order"
                )
            return plan_receive(layout, remote_order or layout.region, remote_block_size)
        except KVHostError as err:
            if len(self.by_layout()) == 1:
                raise  # every layer alike: the message needs no layer's name
            others = f" and {len(members) - 1} more of its strides" if len(members) > 1 else ""
            raise type(err)(f"{members[0].name}{others}: {err}") from None

    def copy_groups(self, dst: CacheSet) -> CopyGroups:
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
        result = CopyGroups(list(groups.values()), _meeting_pairs(src.members, dest.members))
        self._copy_groups.put(id(dst), (dst, result))  # the entry keeps dst alive: its id stays its own
        return result

    def split_k(self) -> CacheSet:
        """The same memory with ``K`` turned into tuple members (views, no copy)."""
        if "K" not in self.member_axes:
            return self
        if "K" in self.layout.region:
            raise LayoutError(
                f"{self.role}: K lies inside the block region {self.layout.region!r}, so these caches cannot be "
                "copied to or from K and V held as two tensors (give both sides K as a dim, or both as tuples)"
            )
        k_dim = self.member_axes.index("K")
        split = {
            name: tuple(t for m in members for t in m.tensor.unbind(k_dim)) for name, members in self.layers.items()
        }
        return CacheSet(split, self.member_axes, role=self.role, own_slices=True)


@dataclass
class CopyGroups:
    """A copy's member pairs grouped by plan, and which source and destination tensors may
    share memory (their spans meet): only for those must the blocks a copy reads be
    compared with the blocks it writes."""

    groups: list[CopyGroup]
    meeting: list[tuple[Member, Member]]


def check_one_device(caches: Mapping[str, object], role: str) -> None:
    """Refuse layers on several devices, reading each tensor's device alone (none of its
    memory facts, which torch_xla cannot give while another thread updates the tensor).
    Anything that is no tensor is left for ``CacheSet`` to name."""
    first: tuple[str, torch.device] | None = None
    for name, layer in caches.items():
        for tensor in layer if isinstance(layer, (tuple, list)) else (layer,):
            if not isinstance(tensor, torch.Tensor):
                return
            if first is None:
                first = (name, tensor.device)
            elif tensor.device != first[1]:
                raise _devices_differ(role, name, tensor.device, *first)


def _devices_differ(role: str, layer: str, device: torch.device, first: str, first_device: torch.device) -> LayoutError:
    return LayoutError(
        f"{role}: layer {layer!r} is on {device} but layer {first!r} is on {first_device}; one call serves one device"
    )


def _not_tensors(layer: object) -> str:
    """What a layer that is no tensor nor tuple of them is, for a message: its kind, and
    which item of a tuple or list is not a tensor."""
    if not isinstance(layer, (tuple, list)) or not layer:
        return f"{'an empty ' if isinstance(layer, (tuple, list)) else ''}{type(layer).__name__}"
    index = next(i for i, t in enumerate(layer) if not isinstance(t, torch.Tensor))
    return f"a {type(layer).__name__} whose item {index} is {shown(layer[index])}"


def _holds_more(layout: Layout) -> bool:
    """Whether a block region holds a letter of more than one index besides its tokens."""
    return any(layout.size(a) > 1 for a in layout.region if a != "N")


def _meeting_pairs(sources: list[Member], destinations: list[Member]) -> list[tuple[Member, Member]]:
    """(source, destination) members whose byte spans meet; tensors without addresses
    (XLA) meet only themselves."""
    spans = [(m.address, m.address + m.layout.extent_bytes, 0, i) for i, m in enumerate(sources) if m.address]
    spans += [(m.address, m.address + m.layout.extent_bytes, 1, i) for i, m in enumerate(destinations) if m.address]
    spans.sort()
    pairs = []
    open_spans: list[tuple[int, int, int]] = []  # (end, side, index) of spans not yet passed
    for start, end, side, index in spans:
        open_spans = [span for span in open_spans if span[0] > start]
        pairs += [
            (sources[i], destinations[index]) if side else (sources[index], destinations[i])
            for _, other, i in open_spans
            if other != side
        ]
        open_spans.append((end, side, index))
    unplaced = [s for s in sources if not s.address]
    if unplaced:
        by_tensor: dict[int, list[Member]] = {}
        for d in destinations:
            by_tensor.setdefault(id(d.tensor), []).append(d)
        pairs += [(s, d) for s in unplaced for d in by_tensor.get(id(s.tensor), ())]
    if not pairs:
        return pairs
    order = {id(m): i for i, m in enumerate(sources + destinations)}
    return sorted(pairs, key=lambda pair: (order[id(pair[0])], order[id(pair[1])]))


@dataclass
class CopyGroup:
    """Source and destination members that share one copy plan.

    ``derived`` is where a backend keeps what it works out from the group once (views of
    its tensors, parameters), so that it lives and dies with the group: a connector's
    groups are kept and reused, a one-off call's go with the call.
    """

    plan: CopyPlan
    pairs: list[tuple[Member, Member]]
    derived: dict[str, object] = field(default_factory=dict, repr=False, compare=False)

    @cached_property
    def sources(self) -> MemberList:
        return MemberList(s for s, _ in self.pairs)

    @cached_property
    def destinations(self) -> MemberList:
        return MemberList(d for _, d in self.pairs)

    @cached_property
    def block_bytes(self) -> int:
        """Bytes one block id moves, over every member pair."""
        return self.plan.block_bytes * len(self.pairs)


@dataclass(eq=False)
class ReceiveGroup:
    """The members of one layout and the rearrangement that a sender's layout takes them
    through; ``derived`` is a backend's, as in CopyGroup."""

    members: MemberList
    layout: Layout
    rearrangement: Rearrangement
    derived: dict[str, object] = field(default_factory=dict, repr=False, compare=False)

    @cached_property
    def member_unit_bytes(self) -> int:
        """Bytes one unit rewrites in one member, over its outer indices."""
        return self.rearrangement.unit_bytes * self.layout.outer_count

    @cached_property
    def unit_bytes(self) -> int:
        """Bytes one unit rewrites, over every member and outer index."""
        return self.member_unit_bytes * len(self.members)


def check_owned_once(members: list[Member], role: str, *, own_slices: bool) -> None:
    """Raise unless every block region of every member is memory no other region shares.

    Two names for one tensor, a tuple holding one tensor twice, two tensors over one
    buffer: each would be rewritten twice by one call. Members whose spans do not meet
    (the usual case: a tensor per layer) are told apart without listing their blocks.
    ``own_slices``: the members are kvhost's own disjoint slices of a set already checked.
    """
    placed = sorted((m.address, m.address + m.layout.extent_bytes, i) for i, m in enumerate(members) if m.address)
    meeting = _spans_that_meet(placed)
    if meeting:
        chosen = [members[i] for i in meeting]
        overlap = find_overlap([lane for m in chosen for lane in m.layout.lanes(m.address, m.name)])
        if overlap is not None:
            raise LayoutError(f"{role}: {overlap.describe()} share memory: a call would rewrite it twice")
    if len(placed) < len(members) and not own_slices:  # no addresses (XLA): only buffers can be told apart
        _check_distinct_buffers([m for m in members if not m.address], role)


def _spans_that_meet(placed: list[tuple[int, int, int]]) -> list[int]:
    """Indices of the spans (sorted ``(start, end, index)``) that meet another span."""
    chosen: list[int] = []
    reach, run = -1, list[int]()
    for start, end, i in [*placed, (1 << 65, 1 << 65, -1)]:
        if start >= reach:
            if len(run) > 1:
                chosen += run
            run = []
        run.append(i)
        reach = max(reach, end)
    return sorted(chosen)


def _check_distinct_buffers(members: list[Member], role: str) -> None:
    """Raise if two members without addresses are views of one buffer. Such a device (XLA)
    reports no storage offset either (every view says 0), so the bytes two views cover cannot
    be compared: K and V unbound from one tensor look exactly like one view given twice."""
    seen: dict[int, Member] = {}
    for member in members:
        first = seen.setdefault(member.tensor.untyped_storage()._cdata, member)
        if first is not member:
            what = "one tensor" if first.tensor is member.tensor else "views of one buffer"
            raise LayoutError(
                f"{role}: {first.name} and {member.name} are {what}, and on {member.tensor.device} kvhost cannot "
                "tell which bytes each covers: a call could rewrite them twice (give each its own tensor, or K "
                "and V as one tensor with a K dim)"
            )


def _check_dtypes(layer: str, src: torch.dtype, dst: torch.dtype) -> None:
    """Bytes move between tensors of one dtype, or between a dtype of one byte and raw bytes
    (an fp8 cache kept as uint8); not into a bool, whose bytes must be 0 or 1."""
    raw = (torch.uint8, torch.int8)
    if src != dst and (dst == torch.bool or not (src.itemsize == dst.itemsize and (src in raw or dst in raw))):
        raise LayoutError(f"layer {layer!r}: source dtype {src} != destination dtype {dst}")


def _layout(tensor: torch.Tensor, axes: str, role: str, layer: str, index: int) -> Layout:
    known = Layout.known(tensor, axes)
    return known if known is not None else Layout.of(tensor, axes, name=f"{role} layer {layer!r}[{index}]")


def tuple_member_axes(axes: str, tensors: tuple[torch.Tensor, ...]) -> str:
    """A tuple's index stands for K when the call's axes have a K the members lack."""
    if "K" in axes and all(t.dim() == len(axes) - 1 for t in tensors):
        return axes.replace("K", "")
    return axes
