"""The coalescing front end: a whole batch of requests becomes one piece of work per group.

It validates everything before any byte moves (ids in range, no id claimed twice, whole
groups, letters), groups requests by transform key, concatenates each group's ids once
with numpy (no per-request torch calls), drops groups whose transform changes nothing,
and hands each remaining group to the backend as a ReceiveJob. Copies become a CopyJob
with the contiguous runs of ids found once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np
import torch

from kvhost.caches import CacheSet, Member
from kvhost.errors import KVHostError, LayoutError, RequestError
from kvhost.layout import Layout
from kvhost.transform import CopyPlan, Rearrangement, plan_copy, plan_receive

Uploader = Callable[[np.ndarray, torch.device], torch.Tensor]
Ids = Sequence[int] | np.ndarray | torch.Tensor


@dataclass(frozen=True)
class Incoming:
    """A finished request: its local block ids in token order, and the sender's layout.

    ``remote_order`` and ``remote_block_size`` default to the call's values, and those to
    the local region order and block size.
    """

    block_ids: Sequence[int] | np.ndarray
    remote_order: str | None = None
    remote_block_size: int | None = None


def upload(ids: np.ndarray, device: torch.device) -> torch.Tensor:
    """Index tensor on ``device`` (zero-copy on the CPU)."""
    return torch.from_numpy(ids).to(device)


class IndexBuffers:
    """Grow-only index buffers on one device, one per thread, reused across calls.

    Safe for work ordered on the thread's current stream; a caller whose work outlives
    the call (a non-blocking copy) should take a fresh tensor instead.
    """

    def __init__(self) -> None:
        self._local = threading.local()

    def __call__(self, ids: np.ndarray, device: torch.device) -> torch.Tensor:
        if device.type == "cpu":
            return upload(ids, device)
        buffer: torch.Tensor | None = getattr(self._local, "buffer", None)
        if buffer is None or buffer.numel() < ids.size or buffer.device != device:
            capacity = max(1024, 1 << int(ids.size - 1).bit_length())
            buffer = torch.empty(capacity, dtype=torch.int64, device=device)
            self._local.buffer = buffer
        view = buffer[: ids.size]
        view.copy_(torch.from_numpy(ids))
        return view


@dataclass
class ReceiveJob:
    """One transform group for one layout: what a backend runs in a single call.

    ``unit_ids[u]`` are the local blocks of unit ``u`` (``rearrangement.parts`` of them);
    every outer index of every member tensor is rearranged for every unit.
    """

    members: list[Member]
    layout: Layout
    rearrangement: Rearrangement
    unit_ids: np.ndarray
    device: torch.device
    uploader: Uploader = field(default=upload, repr=False)

    @cached_property
    def device_ids(self) -> torch.Tensor:
        """``unit_ids`` flattened, on the cache's device; uploaded once, on first use."""
        return self.uploader(self.unit_ids.reshape(-1), self.device)

    @property
    def bytes_moved(self) -> int:
        units = int(self.unit_ids.shape[0])
        return units * self.rearrangement.unit_bytes * self.layout.outer_count * len(self.members)


@dataclass
class ReceiveBatch:
    """The validated batch: the jobs to run and what they amount to."""

    jobs: list[ReceiveJob]
    requests: int
    blocks: int
    groups: int  # transform groups with work to do
    skipped_blocks: int  # blocks whose transform is the identity: nothing copied

    @property
    def bytes_moved(self) -> int:
        return sum(job.bytes_moved for job in self.jobs)


def plan_receive_batch(
    caches: CacheSet,
    requests: Mapping[str, Sequence[int] | Incoming | np.ndarray],
    remote_order: str | None,
    remote_block_size: int | None,
    uploader: Uploader = upload,
) -> ReceiveBatch:
    """Validate the whole batch and turn it into one ReceiveJob per (layout, transform)."""
    names = list(requests)
    ids, offsets = _concatenate(names, [_block_ids(requests[n]) for n in names])
    _check_range(ids, offsets, names, caches.num_blocks, what="block id")
    _check_unique(ids, offsets, names)

    # Transform key per request; the planner validates letters and sizes once per key.
    local = caches.layout
    keys: dict[tuple[str, int], int] = {}
    key_of_request = np.empty(len(names), dtype=np.int64)
    for i, name in enumerate(names):
        request = requests[name]
        order = getattr(request, "remote_order", None) or remote_order or local.region
        size = getattr(request, "remote_block_size", None) or remote_block_size or local.block_size
        key_of_request[i] = keys.setdefault((order, int(size)), len(keys))
    key_list = list(keys)
    plans: dict[tuple[Layout, int], Rearrangement | None] = {}
    for layout, _ in caches.by_layout():
        for k, (order, size) in enumerate(key_list):
            try:
                plans[layout, k] = plan_receive(layout, order, size)
            except KVHostError as err:
                first = names[int(np.argmax(key_of_request == k))]
                raise RequestError(f"request {first!r}: {err}") from None

    # Whole groups are owed even when the transform is the identity: a sender block spans g.
    lengths = np.diff(offsets)
    parts_of_key = np.array([max(size // local.block_size, 1) for _, size in key_list])
    partial = lengths % parts_of_key[key_of_request] != 0
    if partial.any():
        i = int(np.argmax(partial))
        g = int(parts_of_key[key_of_request[i]])
        size = key_list[key_of_request[i]][1]
        raise RequestError(
            f"request {names[i]!r}: {int(lengths[i])} block ids are not whole groups of {g} "
            f"(remote block size {size} = {g} x local block size {local.block_size})"
        )

    jobs: list[ReceiveJob] = []
    groups = skipped = 0
    request_key = np.repeat(key_of_request, lengths)
    for k in range(len(key_list)):
        group_ids = ids[request_key == k]
        layout_jobs = [
            ReceiveJob(members, layout, plan, group_ids.reshape(-1, plan.parts), caches.device, uploader)
            for layout, members in caches.by_layout()
            if (plan := plans[layout, k]) is not None and group_ids.size
        ]
        if layout_jobs:
            groups += 1
            jobs += layout_jobs
        else:
            skipped += group_ids.size
    return ReceiveBatch(jobs, requests=len(names), blocks=int(ids.size), groups=groups, skipped_blocks=skipped)


@dataclass
class CopyJob:
    """Block ``dst_ids[i]`` of every destination member receives ``src_ids[i]`` of its source."""

    pairs: list[tuple[Member, Member]]
    plan: CopyPlan
    src_ids: np.ndarray
    dst_ids: np.ndarray
    runs: np.ndarray  # [n, 3]: source start, destination start, count of consecutive ids
    non_blocking: bool

    @property
    def bytes_moved(self) -> int:
        return self.src_ids.size * self.plan.block_bytes * len(self.pairs)


@dataclass
class CopyBatch:
    jobs: list[CopyJob]
    blocks: int

    @property
    def bytes_moved(self) -> int:
        return sum(job.bytes_moved for job in self.jobs)

    @property
    def runs(self) -> int:
        return int(self.jobs[0].runs.shape[0]) if self.jobs else 0


def plan_copy_batch(
    src: CacheSet,
    dst: CacheSet,
    src_ids: Ids,
    dst_ids: Ids,
    non_blocking: bool,
) -> CopyBatch:
    """Validate a copy and pair up every source tensor with its destination."""
    if set(src.layers) != set(dst.layers):
        only_src = sorted(set(src.layers) - set(dst.layers))
        only_dst = sorted(set(dst.layers) - set(src.layers))
        raise LayoutError(f"layer names differ: only in src {only_src}, only in dst {only_dst}")
    source, dest = _as_int_array(src_ids, "src_ids"), _as_int_array(dst_ids, "dst_ids")
    if source.size != dest.size:
        raise RequestError(f"src_ids has {source.size} ids but dst_ids has {dest.size}")
    _check_range(source, np.array([0, source.size]), ["src_ids"], src.num_blocks, what="source block id")
    _check_range(dest, np.array([0, dest.size]), ["dst_ids"], dst.num_blocks, what="destination block id")
    _check_unique(dest, np.array([0, dest.size]), ["dst_ids"])
    if source.size == 0:
        return CopyBatch(jobs=[], blocks=0)

    # A tuple on one side and a K axis on the other: look at the K axis as tuple members.
    if len(src.members) != len(dst.members):
        src, dst = src.split_k(), dst.split_k()
    pairs: list[tuple[Member, Member]] = []
    for name, src_members in src.layers.items():
        dst_members = dst.layers[name]
        if len(src_members) != len(dst_members):
            raise LayoutError(
                f"layer {name!r}: {len(src_members)} source tensors but {len(dst_members)} destination tensors"
            )
        for s, d in zip(src_members, dst_members):
            _check_dtypes(name, s.tensor.dtype, d.tensor.dtype)
            if _same_memory(s.tensor, d.tensor) and np.intersect1d(source, dest).size:
                both = int(np.intersect1d(source, dest)[0])
                raise RequestError(f"layer {name!r}: block {both} is both read and written by one copy")
            pairs.append((s, d))

    breaks = np.flatnonzero((np.diff(source) != 1) | (np.diff(dest) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    counts = np.diff(np.concatenate((starts, [source.size])))
    runs = np.stack([source[starts], dest[starts], counts], axis=1)

    jobs: dict[tuple[Layout, Layout], CopyJob] = {}
    for s, d in pairs:
        key = (s.layout, d.layout)
        if key not in jobs:
            try:
                plan = plan_copy(s.layout, d.layout)
            except KVHostError as err:
                raise LayoutError(f"layer {s.layer!r}: {err}") from None
            jobs[key] = CopyJob([], plan, source, dest, runs, non_blocking)
        jobs[key].pairs.append((s, d))
    return CopyBatch(jobs=list(jobs.values()), blocks=int(source.size))


# --- helpers -------------------------------------------------------------------------


def _block_ids(request: Any) -> Any:
    return request.block_ids if isinstance(request, Incoming) else request


def _as_int_array(ids: Any, name: str) -> np.ndarray:
    if isinstance(ids, torch.Tensor):
        ids = ids.detach().cpu().numpy()
    array = np.asarray(ids)
    if array.size == 0:
        return np.zeros(0, dtype=np.int64)
    if array.dtype.kind not in "iu" or array.ndim != 1:
        raise RequestError(f"{name}: block ids must be a flat sequence of integers, got {array.dtype} {array.shape}")
    return array.astype(np.int64, copy=False)


def _concatenate(names: list[str], id_lists: list[Any]) -> tuple[np.ndarray, np.ndarray]:
    arrays = [_as_int_array(ids, f"request {name!r}") for name, ids in zip(names, id_lists)]
    offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
    np.cumsum([a.size for a in arrays], out=offsets[1:])
    ids = np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.int64)
    return ids, offsets


def _owner(offsets: np.ndarray, position: int) -> int:
    return int(np.searchsorted(offsets, position, side="right")) - 1


def _check_range(ids: np.ndarray, offsets: np.ndarray, names: list[str], limit: int, *, what: str) -> None:
    bad = np.flatnonzero((ids < 0) | (ids >= limit))
    if bad.size:
        position = int(bad[0])
        owner = _owner(offsets, position)
        raise RequestError(
            f"{_subject(names[owner])}: {what} {int(ids[position])} at position "
            f"{position - int(offsets[owner])} is out of range [0, {limit})"
        )


def _check_unique(ids: np.ndarray, offsets: np.ndarray, names: list[str]) -> None:
    if ids.size < 2:
        return
    order = np.argsort(ids, kind="stable")
    same = np.flatnonzero(ids[order[1:]] == ids[order[:-1]])
    if same.size:
        first, second = int(order[same[0]]), int(order[same[0] + 1])
        a, b = names[_owner(offsets, first)], names[_owner(offsets, second)]
        block = int(ids[first])
        if a == b:
            raise RequestError(f"{_subject(a)}: block id {block} appears twice")
        raise RequestError(f"block id {block} is claimed by request {a!r} and request {b!r}")


def _subject(name: str) -> str:
    """Requests are named by their id; a copy's two id lists by their argument name."""
    return name if name in ("src_ids", "dst_ids") else f"request {name!r}"


def _check_dtypes(layer: str, src: torch.dtype, dst: torch.dtype) -> None:
    raw = (torch.uint8, torch.int8)
    if src != dst and not (src.itemsize == dst.itemsize and (src in raw or dst in raw)):
        raise LayoutError(f"layer {layer!r}: source dtype {src} != destination dtype {dst}")


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.device != b.device or a.device.type == "xla":
        return a is b
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
