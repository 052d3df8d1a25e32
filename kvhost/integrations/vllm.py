"""kvhost in vLLM's words: the worker side of a KV connector, one kvhost call per step.

vLLM hands a connector its caches as a dict of per-layer tensors, named in one of two
vocabularies:

- **Cache formats** of the attention backends: ``"flash_attn"``
  ``[2, num_blocks, block_size, heads, head_dim]``, ``"flashinfer"``
  ``[num_blocks, 2, block_size, heads, head_dim]`` and ``"mla"``
  ``[num_blocks, block_size, latent]`` (vLLM before 0.33). A heads-first ("HND") cache
  has the same shape with permuted strides; kvhost reads the memory order from the
  strides. From vLLM 0.33 on, every backend's cache is a 4-dim layer view
  ``[num_blocks, heads, block_size, 2 * head_dim]`` (below), whatever the format's name.
- **KVCacheLayout names** (``LBHNC`` ``LBNHC`` ``LHBNC`` ``BLHNC`` ``BLNHC`` ``BHLNC``):
  the logical ``[L, B, H, N, C]`` of a cache group (C holds one head's K and V for one
  token) stored in the named memory order. A layer's cache is the view ``[B, H, N, C]``;
  ``cross_layer_view`` gives back the group's ``[L, B, H, N, C]``, and ``VllmCaches``
  does so itself for layer views whose block is not one run of bytes (``BHLNC``).

A remote engine is what its handshake says: its layout name (a KVCacheLayout name, or
``"NHD"``/``"HND"`` for an engine that keeps layers apart and lays a layer's blocks out
like ours, tokens or heads first) and its block size.
``VllmCaches`` then does the connector's three worker-side steps for a whole batch at
once: save blocks to the host buffer, load them back, and post-process received blocks.
Nothing here imports vLLM.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np
import torch

from kvhost.api import KVHost
from kvhost.backend import Backend
from kvhost.batch import Incoming
from kvhost.caches import CacheSet, Layer, Member
from kvhost.errors import ArgumentError, KVHostError, LayoutError, RequestError, shown, shown_name
from kvhost.ids import IdBatch, integer_value
from kvhost.layout import Layout, checked_letters, not_plain
from kvhost.stats import CopyResult, ReceiveStats

KV_CACHE_LAYOUTS = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")
CACHE_FORMATS = {"flash_attn": "KBNHC", "flashinfer": "BKNHC", "mla": "BNC"}  # format -> axes in shape order
TOKEN_HEAD_ORDERS = ("NHD", "HND")
GROUP_AXES = "LBHNC"  # a KVCacheLayout group in shape order; a layer view drops L

GROUP_NAME = "cross-layer group"  # the one member of layer views seen as their group
BlockIds = Sequence[int] | np.ndarray


def kv_cache_axes(layout: str, shape: Sequence[int]) -> str:
    """The ``axes`` kvhost needs for a vLLM cache of ``shape`` described by ``layout``.

    ``layout`` is a cache format (``flash_attn``, ``flashinfer``, ``mla``) or a KVCacheLayout
    name; a KVCacheLayout cache is a layer view ``[B, H, N, C]`` or a group ``[L, B, H, N, C]``.
    """
    _check_name(layout, "layout", LayoutError)
    dims = _dims(shape)
    if layout in CACHE_FORMATS and len(dims) == len(GROUP_AXES) - 1:
        return GROUP_AXES[1:]  # vLLM 0.33: every backend's layer view is [B, H, N, C]
    if layout in CACHE_FORMATS:
        axes = CACHE_FORMATS[layout]
        if len(dims) != len(axes):
            raise LayoutError(
                f"a {layout} cache is [{', '.join(axes)}] ({len(axes)} dims) or, from vLLM 0.33 on, a layer "
                f"view [B, H, N, C] (4 dims), but shape {dims} has {len(dims)}"
            )
        if "K" in axes and dims[axes.index("K")] != 2:
            raise LayoutError(
                f"a {layout} cache holds K and V in dim {axes.index('K')}, which must be 2; "
                f"shape {dims} has {dims[axes.index('K')]}"
            )
        return axes
    if layout in KV_CACHE_LAYOUTS:
        if len(dims) == len(GROUP_AXES):
            return GROUP_AXES
        if len(dims) == len(GROUP_AXES) - 1:
            if layout == "BHLNC" and dims[1] > 1:
                raise LayoutError(
                    f"a BHLNC layer view {dims} has no contiguous block region (each head's tokens are a "
                    "run of their own, with the other layers between them); describe the group's "
                    "[L, B, H, N, C] tensor instead (cross_layer_view)"
                )
            return GROUP_AXES[1:]
        raise LayoutError(
            f"a {layout} cache is a layer view [B, H, N, C] or a group [L, B, H, N, C]; "
            f"shape {dims} has {len(dims)} dims"
        )
    known = ", ".join([*CACHE_FORMATS, *KV_CACHE_LAYOUTS])
    raise LayoutError(f"unknown vLLM cache layout {shown(layout)}; known: {known}")


def remote_order(axes: str, physical: str, remote_layout: str) -> str:
    """The sender's order of the bytes NIXL leaves in one of our block regions.

    ``axes`` and ``physical`` describe our caches (shape order, memory order). A
    KVCacheLayout name is the sender's memory order; ``"NHD"``/``"HND"`` name an engine
    that keeps layers apart and, inside a layer, our memory order with tokens or heads
    first. A region sees the sender's order of its own letters only.
    """
    axes = checked_letters(axes, what="axes")
    physical = checked_letters(physical, what="physical order")
    if "B" not in physical or set(axes) - set(physical) - {"K"} or set(physical) - set(axes):
        # A tuple layer's tensors lack K (the tuple's index stands for it): their order may too.
        raise LayoutError(
            f"physical order {shown(physical)} must be the letters of axes {shown(axes)} (K may be left out)"
        )
    _check_name(remote_layout, "remote layout", RequestError)
    region = physical[physical.index("B") + 1 :]
    if remote_layout in TOKEN_HEAD_ORDERS:
        sender = "L" + _tokens_heads(physical.replace("L", ""), remote_layout)
    elif remote_layout in KV_CACHE_LAYOUTS:
        if "K" in axes:
            raise RequestError(
                f"remote layout {shown(remote_layout)} keeps K and V together in C, but the local caches "
                f"({shown(axes)}) keep them apart in K: such engines cannot exchange blocks"
            )
        sender = remote_layout
    else:
        known = ", ".join([*TOKEN_HEAD_ORDERS, *KV_CACHE_LAYOUTS])
        raise RequestError(f"unknown remote layout {shown(remote_layout)}; known: {known}")
    return "".join(a for a in sender if a in region)


def _tokens_heads(order: str, name: str) -> str:
    """``order`` with N and H trading places if needed, so that they read as ``name`` (NHD/HND)."""
    if "N" not in order or "H" not in order:
        return order
    slots = sorted((order.index("N"), order.index("H")))
    letters = list(order)
    letters[slots[0]], letters[slots[1]] = (name[0], name[1])
    return "".join(letters)


def cross_layer_view(kv_caches: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The group's ``[L, B, H, N, C]`` tensor behind vLLM's per-layer views, without a copy.

    vLLM cuts one buffer into layer views at a constant layer stride; this undoes the cut,
    so a layout whose layer views have no contiguous block region (``BHLNC``) can be
    described whole. Layers, in dict order, must share storage, shape, strides and dtype.
    """
    _check_mapping(kv_caches, "kv_caches")
    views = list(kv_caches.items())
    if not views:
        raise LayoutError("kv_caches: no layers given")
    first_name, first = views[0]
    for name, view in views:
        if not isinstance(view, torch.Tensor):
            raise LayoutError(f"layer {shown_name(name)} is a {type(view).__name__}, not a tensor view")
        _check_plain(name, view)
        if (view.shape, view.stride(), view.dtype) != (first.shape, first.stride(), first.dtype):
            raise LayoutError(
                f"layer {shown_name(name)} is {tuple(view.shape)} {view.dtype} with strides {view.stride()}, but layer "
                f"{shown_name(first_name)} is {tuple(first.shape)} {first.dtype} with strides {first.stride()}"
            )
        if view.untyped_storage().data_ptr() != first.untyped_storage().data_ptr():
            raise LayoutError(
                f"layer {shown_name(name)} is not a view of the buffer that holds layer {shown_name(first_name)}"
            )
    offsets = [view.storage_offset() for _, view in views]
    step = offsets[1] - offsets[0] if len(offsets) > 1 else 1
    uneven = [i for i in range(2, len(offsets)) if offsets[i] - offsets[i - 1] != step]  # the first gap is step
    if step <= 0 or uneven:
        raise LayoutError(f"layer offsets {offsets} (in elements) are not evenly spaced upwards")
    return first.as_strided((len(views), *first.shape), (step, *first.stride()), offsets[0])


@dataclass(frozen=True)
class RemoteEngine:
    """A remote engine as its handshake describes it: layout name and tokens per block."""

    kv_cache_layout: str
    block_size: int


class VllmCaches:
    """A vLLM worker's caches, registered once; each connector step is one kvhost call.

    ``kv_caches`` is vLLM's per-layer dict (or ``{name: group tensor}``), and ``layout``
    names it in vLLM's words (see ``kv_cache_axes``). Caches vLLM has no name for, such as
    a platform plugin's, give kvhost's letters as ``axes`` instead.

    Layer views of one buffer whose block is not one run of bytes (``BHLNC``) are described
    as the group behind them, ``[L, B, H, N, C]``; ``group=True`` describes them so
    wherever there are several, so that a block region is a block's row of every layer.
    That is what a connector needs whose NIXL regions are those rows: vLLM registers a
    block-major buffer so where a layer's block is not its ``[H, N, C]`` in order
    (``BLNHC`` too), and the bytes a sender's rows leave there are rearranged row by row.
    """

    def __init__(
        self,
        kv_caches: Mapping[str, Layer],
        layout: str | None = None,
        *,
        axes: str | None = None,
        backend: str | Backend | None = None,
        group: bool = False,
    ) -> None:
        if (layout is None) == (axes is None):
            raise LayoutError("give exactly one of layout (a vLLM name) and axes (kvhost letters)")
        if not isinstance(group, bool):
            raise ArgumentError(f"group must be True or False, got {shown(group)}")
        if group and layout is None:
            raise ArgumentError("group=True describes vLLM's layer views: give their layout name, not axes")
        _check_mapping(kv_caches, "kv_caches")
        self.layer_names: tuple[str, ...] | None = None  # set when the layers are seen as their group
        if layout is not None:
            first = _first_tensor(kv_caches, layout)
            if first.dim() == len(GROUP_AXES) - 1 and len(kv_caches) > 1 and (group or not _block_is_one_run(first)):
                # A layer view whose block is not one run of bytes (BHLNC: the other layers
                # sit between its heads), or rows asked for: describe the group behind the views.
                if layout not in KV_CACHE_LAYOUTS:
                    kv_cache_axes(layout, first.shape)  # the name must fit a layer view
                self.layer_names = tuple(kv_caches)
                kv_caches = {GROUP_NAME: cross_layer_view(cast(Mapping[str, torch.Tensor], kv_caches))}
                axes = GROUP_AXES
            elif layout == "BHLNC" and first.dim() == len(GROUP_AXES) - 1 and _block_is_one_run(first):
                axes = GROUP_AXES[1:]  # a buffer of one layer (no other layers between its heads)
            else:
                axes = kv_cache_axes(layout, first.shape)
        assert axes is not None
        self.layout_name = layout
        self.axes = axes
        self._kvhost = KVHost(kv_caches, axes=axes, backend=backend)
        if layout in KV_CACHE_LAYOUTS:
            self._check_memory_order(layout)
        self._orders: dict[str, str] = {}

    @property
    def caches(self) -> CacheSet:
        return self._kvhost.caches

    @property
    def backend(self) -> Backend:
        return self._kvhost.backend

    @property
    def num_blocks(self) -> int:
        return self.caches.num_blocks

    def remote_order(self, remote_layout: str) -> str:
        """The order NIXL leaves a ``remote_layout`` sender's bytes in our block regions."""
        _check_name(remote_layout, "remote layout", RequestError)
        if remote_layout not in self._orders:
            self._orders[remote_layout] = remote_order(self.axes, self.caches.layout.physical, remote_layout)
        return self._orders[remote_layout]

    # --- the three worker-side steps ----------------------------------------------------

    def save_to_host(
        self,
        host_buffers: Mapping[str, Layer],
        block_ids: Mapping[str, BlockIds],
        *,
        host_axes: str | None = None,
        non_blocking: bool = False,
    ) -> CopyResult:
        """Copy every request's blocks to the same block ids of the host buffers, in one call.

        ``block_ids`` maps request id to block ids; blocks shared by several requests (a
        common prefix) are copied once. ``host_axes`` names the host buffers' dims when
        they differ from ours: the copy rearranges on the way.
        """
        host = self._as_described(host_buffers)
        ids = self._batch_ids(block_ids, _block_count(host, host_axes or self.axes))
        return self._kvhost.copy_to(host, ids, ids, dst_axes=host_axes, non_blocking=non_blocking)

    def load_from_host(
        self,
        host_buffers: Mapping[str, Layer],
        block_ids: Mapping[str, BlockIds],
        *,
        host_axes: str | None = None,
        non_blocking: bool = False,
    ) -> CopyResult:
        """Copy every request's blocks from the host buffers into the same block ids here."""
        host = self._as_described(host_buffers)
        ids = self._batch_ids(block_ids, _block_count(host, host_axes or self.axes))
        return self._kvhost.copy_from(host, ids, ids, src_axes=host_axes, non_blocking=non_blocking)

    def post_process(
        self,
        received: Mapping[str, Mapping[str, BlockIds]],
        remote_engines: Mapping[str, RemoteEngine],
        *,
        tokens: Mapping[str, int] | None = None,
    ) -> ReceiveStats:
        """Rearrange, in place, every received block from its sender's layout into ours.

        ``received`` maps remote engine id to request id to the request's local block ids
        in token order; ``remote_engines`` says how each engine lays out its blocks.
        ``tokens`` maps a request id to how many of its tokens arrived, for requests whose
        blocks they do not fill: only the sender blocks holding those tokens are
        rearranged, and every token after them in the request's blocks is zeroed, as
        vLLM does. The whole batch is checked before any byte moves, and requests whose
        senders share a layout and block size are rearranged together.
        """
        if not isinstance(received, Mapping):
            raise RequestError(
                f"received must map engine id to {{request id: block ids}}, got {type(received).__name__}"
            )
        if not isinstance(remote_engines, Mapping):
            raise RequestError(
                f"remote_engines must map engine id to RemoteEngine, got {type(remote_engines).__name__}"
            )
        requests: dict[str, BlockIds] = {}
        engine_of: dict[str, str] = {}
        sender: dict[str, tuple[str, int]] = {}  # engine -> its remote order and block size
        for engine_id, by_request in received.items():
            if not isinstance(engine_id, str):
                raise RequestError(f"engine ids must be strings, got {shown(engine_id)} ({type(engine_id).__name__})")
            if not isinstance(by_request, Mapping):
                raise RequestError(
                    f"engine {shown_name(engine_id)}: received must map request id to block ids, "
                    f"got {type(by_request).__name__}"
                )
            sender[engine_id] = self._sender(engine_id, remote_engines)
            for request_id, ids in by_request.items():
                if not isinstance(request_id, str):
                    raise RequestError(
                        f"engine {shown_name(engine_id)}: request ids must be strings, got {shown(request_id)} "
                        f"({type(request_id).__name__})"
                    )
                if request_id in engine_of:
                    raise RequestError(
                        f"request {shown_name(request_id)} is listed under engine {shown_name(engine_of[request_id])} "
                        f"and engine {shown_name(engine_id)}"
                    )
                engine_of[request_id] = engine_id
                requests[request_id] = ids
        if tokens is not None and not isinstance(tokens, Mapping):
            raise RequestError(
                f"tokens must map request id to a token count, got {type(tokens).__name__} {shown(tokens)}"
            )
        if tokens:
            unknown = [r for r in tokens if r not in engine_of]
            if unknown:
                raise RequestError(f"tokens name request {shown(unknown[0])}, which no engine sent")
            return self._kvhost.receive(
                {r: Incoming(ids, *sender[engine_of[r]], tokens=tokens.get(r)) for r, ids in requests.items()}
            )
        layouts = {sender[engine] for engine in engine_of.values()}
        if len(layouts) == 1:
            # Every sender lays blocks out alike: say so once for the call, so that a step
            # whose bytes already read right is only counted, not checked id by id.
            ((order, size),) = layouts
            try:
                return self._kvhost.receive(requests, remote_order=order, remote_block_size=size)
            except ArgumentError as err:  # the senders' spec, given for the call: name the senders
                raise RequestError(f"engine {', '.join(map(repr, received))}: {err}") from None
        return self._kvhost.receive({r: Incoming(ids, *sender[engine_of[r]]) for r, ids in requests.items()})

    def _sender(self, engine_id: str, remote_engines: Mapping[str, RemoteEngine]) -> tuple[str, int]:
        """The remote order and block size of an engine that sent blocks, from its
        ``RemoteEngine``, checked."""
        if engine_id not in remote_engines:
            known = ", ".join(map(shown_name, remote_engines)) or "none"
            raise RequestError(f"engine {shown_name(engine_id)} sent blocks but has no RemoteEngine (known: {known})")
        remote = remote_engines[engine_id]
        if not isinstance(remote, RemoteEngine):
            raise RequestError(
                f"engine {shown_name(engine_id)}: remote_engines gives a {type(remote).__name__}, not a RemoteEngine"
            )
        if not isinstance(remote.kv_cache_layout, str):
            raise RequestError(
                f"engine {shown_name(engine_id)}: layout {shown(remote.kv_cache_layout)} must be a layout name (a str)"
            )
        block_size = integer_value(remote.block_size)  # a numpy integer is one; a bool is not
        if block_size is None or block_size <= 0:
            raise RequestError(
                f"engine {shown_name(engine_id)}: block size {shown(remote.block_size)} must be a positive integer"
            )
        try:
            return self.remote_order(remote.kv_cache_layout), block_size
        except RequestError as err:
            raise RequestError(f"engine {shown_name(engine_id)}: {err}") from None

    # --- host buffers ---------------------------------------------------------------------

    def host_buffers(self, *, physical: str | None = None, num_blocks: int | None = None) -> dict[str, Layer]:
        """Host tensors shaped like our caches, laid out in memory as ``physical``.

        ``physical`` uses our letters (``K`` is dropped for tuple layers, whose tuple index
        stands for it); by default each buffer keeps its cache's memory order, made dense.
        ``num_blocks`` defaults to ours, as vLLM maps host blocks one to one.
        """
        blocks = self.num_blocks if num_blocks is None else integer_value(num_blocks)  # a bool is no count
        if blocks is None or blocks <= 0:
            raise LayoutError(f"num_blocks {shown(num_blocks)} must be a positive integer")
        if physical is not None and not isinstance(physical, str):
            raise LayoutError(f"physical must be a string of the caches' axis letters or None, got {shown(physical)}")
        buffers: dict[str, Layer] = {}
        for name, members in self.caches.layers.items():
            tensors = tuple(_host_tensor(member, physical, blocks) for member in members)
            is_tuple = len(members) > 1 or self.caches.tuple_is_k
            buffers[name] = tensors if is_tuple else tensors[0]
        if self.layer_names is not None:  # layer views, as vLLM registers them, of one group buffer
            group = buffers[GROUP_NAME]
            assert isinstance(group, torch.Tensor)
            return {name: group[i] for i, name in enumerate(self.layer_names)}
        return buffers

    # --- helpers --------------------------------------------------------------------------

    def _batch_ids(self, block_ids: Mapping[str, BlockIds], host_blocks: int | None = None) -> np.ndarray:
        """Every request's ids, checked and named by request against our block count and the
        host buffers' (``host_blocks``, where it can be read off them), each block once, ascending."""
        if not isinstance(block_ids, Mapping):
            raise RequestError(f"block ids must map request id to block ids, got {type(block_ids).__name__}")
        limit, what = self.num_blocks, "block id"
        if host_blocks is not None and host_blocks < limit:
            limit, what = host_blocks, "host buffer block id"
        batch = IdBatch(limit, what=what, unique=False)  # a shared prefix names a block twice: copied once
        for request_id, ids in block_ids.items():
            if not isinstance(request_id, str):
                raise RequestError(
                    f"request ids must be strings, got {shown(request_id)} ({type(request_id).__name__})"
                )
            batch.add(f"request {shown_name(request_id)}", ids)
        batch.check()
        # Ascending ids make the longest runs of consecutive blocks: fewer, larger copies.
        return np.unique(batch.array())

    def _as_described(self, buffers: Mapping[str, Layer]) -> Mapping[str, Layer]:
        """Buffers in the words our caches are described in: layer views of one buffer
        become their group when ours did; anything else is taken as given."""
        if self.layer_names is None or set(buffers) != set(self.layer_names):
            return buffers
        ordered = {name: buffers[name] for name in self.layer_names}
        try:
            return {GROUP_NAME: cross_layer_view(cast(dict[str, torch.Tensor], ordered))}
        except LayoutError as err:
            raise LayoutError(
                f"our layers are views of one buffer, seen as their group; so must the host buffers be "
                f"(host_buffers() makes them): {err}"
            ) from None

    def _check_memory_order(self, name: str) -> None:
        """Refuse caches whose strides say another KVCacheLayout than ``name``."""
        for layout, members in self.caches.by_layout():
            expected = "".join(a for a in name if a in layout.axes)
            if _sized(layout, layout.physical) != _sized(layout, expected):
                raise LayoutError(
                    f"layer {shown(members[0].layer)} is stored {layout.physical} (strides {layout.strides}), "
                    f"but layout {shown(name)} stores a {layout.axes} cache as {expected}"
                )


def _block_count(buffers: Mapping[str, Layer], axes: str) -> int | None:
    """The fewest blocks any of ``buffers``' tensors holds, read as ``axes`` (a tuple
    layer's tensors without ``K``); None where no tensor has that many dims, whose
    description kvhost's copy then refuses itself."""
    if not isinstance(axes, str):
        return None
    counts: list[int] = []
    for layer in buffers.values() if isinstance(buffers, Mapping) else ():
        tensors = layer if isinstance(layer, tuple) else (layer,)
        letters = axes.replace("K", "") if isinstance(layer, tuple) else axes
        counts.extend(
            t.shape[letters.index("B")]
            for t in tensors
            if isinstance(t, torch.Tensor) and t.dim() == len(letters) and "B" in letters
        )
    return min(counts) if counts else None


def _block_is_one_run(tensor: torch.Tensor) -> bool:
    """Whether a ``[B, H, N, C]`` layer view's block (its letters inside B) is one dense run of bytes."""
    block = tensor.stride(0)
    inside = zip(tensor.stride()[1:], tensor.shape[1:])
    sized = sorted(((st, n) for st, n in inside if n > 1 and (st < block or tensor.shape[0] == 1)), reverse=True)
    dense = 1
    for stride, size in reversed(sized):
        if stride != dense:
            return False
        dense *= size
    return True


def _sized(layout: Layout, order: str) -> str:
    """``order`` without size-1 letters, whose place in memory order strides cannot show."""
    return "".join(a for a in order if layout.size(a) > 1)


def _check_mapping(kv_caches: object, what: str) -> None:
    if not isinstance(kv_caches, Mapping):
        raise LayoutError(f"{what} must map layer name to tensor, got {type(kv_caches).__name__}")


def _check_name(name: object, what: str, error: type[KVHostError]) -> None:
    if not isinstance(name, str):
        raise error(f"{what} must be a name (a str), got {shown(name)}")


def _dims(shape: object) -> tuple[int, ...]:
    """A cache's shape as ints; anything that is not a sequence of integers is refused, not cast."""
    if isinstance(shape, torch.Size):
        return tuple(shape)
    if not isinstance(shape, Sequence) or isinstance(shape, str):
        raise LayoutError(f"a cache's shape must be a sequence of integers, got {shown(shape)}")
    dims = tuple(map(integer_value, shape))
    if None in dims:
        dim = shape[dims.index(None)]
        raise LayoutError(f"a cache's shape must be a sequence of integers, got {shown(dim)} in {shown(tuple(shape))}")
    if any(d < 0 for d in dims):  # type: ignore[operator]  # none is None
        raise LayoutError(f"a cache's shape has a negative size: {tuple(shape)}")
    return dims  # type: ignore[return-value]


def _first_tensor(kv_caches: Mapping[str, Layer], layout: str) -> torch.Tensor:
    if not kv_caches:
        raise LayoutError("kv_caches: no layers given")
    name, first = next(iter(kv_caches.items()))
    if not isinstance(first, torch.Tensor):
        raise LayoutError(
            f"layer {shown_name(name)} is a {type(first).__name__}; layout {shown(layout)} describes single tensors, "
            "describe tuple layers with axes= (e.g. 'KBNHC' for (K, V) pairs of [B, N, H, C])"
        )
    _check_plain(name, first)
    return first


def _check_plain(name: str, tensor: torch.Tensor) -> None:
    """Refuse a layer whose blocks cannot be found by strides (nested, sparse, quantized),
    before its strides or storage are read."""
    why = not_plain(tensor)
    if why is not None:
        raise LayoutError(f"layer {shown_name(name)}: {why}")


def _host_tensor(member: Member, physical: str | None, num_blocks: int) -> torch.Tensor:
    layout = member.layout
    order = layout.physical
    if physical is not None:
        order = physical if "K" in layout.axes else physical.replace("K", "")
        if sorted(order) != sorted(layout.axes):
            raise LayoutError(
                f"host layout {shown(physical)} must use the letters of the caches' axes ({shown(layout.axes)})"
            )
    sizes = dict(zip(layout.axes, layout.shape))
    sizes["B"] = num_blocks
    try:
        memory = torch.empty([sizes[a] for a in order], dtype=member.tensor.dtype)
    except (RuntimeError, TypeError, OverflowError) as err:  # too large to count (past int64) or to allocate
        raise LayoutError(f"host buffers of {num_blocks} blocks cannot be made: {err}") from None
    return memory.permute([order.index(a) for a in layout.axes])
