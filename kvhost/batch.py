"""The coalescing front end: a whole batch of requests becomes one piece of work per group.

It validates everything before any byte moves (ids in range, no id claimed twice, whole
groups, letters), groups requests by transform key, concatenates each group's ids once
with numpy (no per-request torch calls), drops groups whose transform changes nothing,
and hands each remaining group to the backend as a ReceiveJob. Copies become a CopyJob
with the contiguous runs of ids found once.
"""

from __future__ import annotations

import bisect
import itertools
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np
import torch

from kvhost.caches import CacheSet, CopyGroup, Member, MemberList
from kvhost.errors import KVHostError, RequestError
from kvhost.layout import Layout, check_letters
from kvhost.memory import first_shared
from kvhost.transform import CopyPlan, Rearrangement, plan_receive

Uploader = Callable[[np.ndarray, torch.device], torch.Tensor]
Ids = Sequence[int] | np.ndarray | torch.Tensor


@dataclass(frozen=True)
class Incoming:
    """A finished request: its local block ids in token order, and the sender's layout.

    ``remote_order`` and ``remote_block_size`` default to the call's values, and those to
    the local region order and block size. It has no length, on purpose: the identity
    check counts a batch's ids with ``len()`` and an Incoming must fail that count.
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

    members: MemberList
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
    """Validate the whole batch and turn it into one ReceiveJob per (layout, transform).

    A batch whose every transform is the identity moves no byte, so there is nothing for
    the checks to protect: its ids are counted, not read, and the call costs about what
    an empty one does (an engine calls it every step whatever the peer's layout).
    """
    if not isinstance(requests, Mapping):
        raise RequestError(f"requests must be a mapping of request id to block ids, got {type(requests).__name__}")
    local = caches.layout
    call_key = (
        _remote_order(remote_order, local.region, "remote_order"),
        _remote_block_size(remote_block_size, local.block_size, "remote_block_size"),
    )
    blocks = _identity_block_count(caches, requests, call_key)
    if blocks is not None:
        return ReceiveBatch([], requests=len(requests), blocks=blocks, groups=0, skipped_blocks=blocks)
    batch = _IdBatch()
    keys: dict[tuple[str, int], int] = {}
    key_of_request: list[int] = []
    for name, request in requests.items():
        subject = f"request {name!r}"
        if isinstance(request, Incoming):
            key = (
                _remote_order(request.remote_order, call_key[0], f"{subject}: remote_order"),
                _remote_block_size(request.remote_block_size, call_key[1], f"{subject}: remote_block_size"),
            )
            batch.add(subject, request.block_ids)
        else:
            key = call_key
            batch.add(subject, request)
        key_of_request.append(keys.setdefault(key, len(keys)))
    batch.check(caches.num_blocks, what="block id", unique=True)

    # The planner validates letters and sizes, once per key and layout.
    key_list = list(keys)
    plans: dict[tuple[Layout, int], Rearrangement | None] = {}
    for layout, _ in caches.by_layout():
        for k, (order, size) in enumerate(key_list):
            try:
                plans[layout, k] = plan_receive(layout, order, size)
            except KVHostError as err:
                raise RequestError(f"{batch.subjects[key_of_request.index(k)]}: {err}") from None

    # Whole groups are owed even when the transform is the identity: a sender block spans g.
    parts = [max(size // local.block_size, 1) for _, size in key_list]
    if any(p > 1 for p in parts):
        for subject, length, k in zip(batch.subjects, batch.lengths, key_of_request):
            if length % parts[k]:
                raise RequestError(
                    f"{subject}: {length} block ids are not whole groups of {parts[k]} "
                    f"(remote block size {key_list[k][1]} = {parts[k]} x local block size {local.block_size})"
                )

    jobs: list[ReceiveJob] = []
    groups = skipped = 0
    with_work = [k for k in range(len(key_list)) if any(plans[layout, k] for layout, _ in caches.by_layout())]
    ids = batch.array() if with_work else None
    request_key = np.repeat(np.array(key_of_request), batch.lengths) if len(key_list) > 1 and with_work else None
    for k in range(len(key_list)):
        if k not in with_work:
            skipped += sum(length for length, key in zip(batch.lengths, key_of_request) if key == k)
            continue
        assert ids is not None
        group_ids = ids if request_key is None else ids[request_key == k]
        if not group_ids.size:
            continue
        groups += 1
        for layout, members in caches.by_layout():
            plan = plans[layout, k]
            if plan is not None:
                jobs.append(
                    ReceiveJob(members, layout, plan, group_ids.reshape(-1, plan.parts), caches.device, uploader)
                )
    return ReceiveBatch(
        jobs, requests=len(batch.subjects), blocks=len(batch.flat), groups=groups, skipped_blocks=skipped
    )


@dataclass
class CopyJob:
    """Block ``dst_ids[i]`` of every destination member receives ``src_ids[i]`` of its source.

    ``group`` holds the member pairs that share ``plan``; ``src_device``/``dst_device``
    are the two sides' devices.
    """

    group: CopyGroup
    src_ids: np.ndarray
    dst_ids: np.ndarray
    non_blocking: bool
    src_device: torch.device
    dst_device: torch.device

    @property
    def plan(self) -> CopyPlan:
        return self.group.plan

    @property
    def pairs(self) -> list[tuple[Member, Member]]:
        return self.group.pairs

    @cached_property
    def runs(self) -> np.ndarray:
        """``[n, 3]``: source start, destination start and count of each run of ids that
        are consecutive on both sides; found once, when a backend first asks."""
        return find_runs(self.src_ids, self.dst_ids)

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


def find_runs(src_ids: np.ndarray, dst_ids: np.ndarray) -> np.ndarray:
    """Runs of ids consecutive in both lists: ``[n, 3]`` rows of source start, destination start, count."""
    breaks = np.flatnonzero((src_ids[1:] - src_ids[:-1] != 1) | (dst_ids[1:] - dst_ids[:-1] != 1)) + 1
    starts = np.concatenate(([0], breaks))
    counts = np.diff(np.concatenate((starts, [src_ids.size])))
    return np.stack([src_ids[starts], dst_ids[starts], counts], axis=1)


def plan_copy_batch(
    src: CacheSet,
    dst: CacheSet,
    src_ids: Ids,
    dst_ids: Ids,
    non_blocking: bool,
) -> CopyBatch:
    """Validate a copy and hand each group of member pairs that share a plan to one job."""
    copy_groups = src.copy_groups(dst)
    sources, dests = _IdBatch(), _IdBatch()
    sources.add("src_ids", src_ids)
    dests.add("dst_ids", dst_ids)
    if len(sources.flat) != len(dests.flat):
        raise RequestError(f"src_ids has {len(sources.flat)} ids but dst_ids has {len(dests.flat)}")
    sources.check(src.num_blocks, what="source block id", unique=False)
    dests.check(dst.num_blocks, what="destination block id", unique=True)
    if not sources.flat:
        return CopyBatch(jobs=[], blocks=0)
    source, dest = sources.array(), dests.array()
    _check_reads_apart_from_writes(copy_groups.meeting, source, dest)
    jobs = [CopyJob(group, source, dest, non_blocking, src.device, dst.device) for group in copy_groups.groups]
    return CopyBatch(jobs=jobs, blocks=int(source.size))


def _check_reads_apart_from_writes(meeting: list[tuple[Member, Member]], source: np.ndarray, dest: np.ndarray) -> None:
    """Raise if a block a copy reads shares a byte with a block it writes: the bytes that
    land would hang on the order the copy runs in (within one cache, crossed layers, two
    tensors over one buffer)."""
    for src, dst in meeting:
        for read in src.layout.lanes(src.address, src.name):
            for written in dst.layout.lanes(dst.address, dst.name):
                overlap = first_shared(read, source, written, dest)
                if overlap is not None:
                    raise RequestError(
                        f"one copy would both read and write the same memory: source {overlap.first.owner} "
                        f"block {overlap.first_block} is destination {overlap.second.owner} "
                        f"block {overlap.second_block}"
                    )


# --- helpers -------------------------------------------------------------------------


def _identity_block_count(caches: CacheSet, requests: Mapping[str, Any], call_key: tuple[str, int]) -> int | None:
    """How many blocks the batch names, when every request takes the call's transform and
    that transform is the identity for every layout; otherwise None (the checked path,
    which also words any error).

    Only the id containers' types are checked here (two passes at C speed); an Incoming,
    a tensor or anything that is not a list, tuple, range or numpy array takes the checked path.
    """
    try:
        if any(plan_receive(layout, *call_key) for layout, _ in caches.by_layout()):
            return None
    except KVHostError:
        return None
    if not set(map(type, requests.values())) <= _PLAIN_ID_LISTS:
        return None
    return sum(map(len, requests.values()))


_PLAIN_ID_LISTS = {list, tuple, range, np.ndarray}
_ID_KINDS = "list, tuple, range, 1-D numpy array or 1-D tensor of integers"


def _remote_order(order: object, default: str, what: str) -> str:
    """A sender's region order as given (None: ``default``); anything but letters is refused."""
    if order is None:
        return default
    check_letters(order, what=what, error=RequestError)  # type: ignore[arg-type]
    return order  # type: ignore[return-value]


def _remote_block_size(size: object, default: int, what: str) -> int:
    """A sender's tokens per block as given (None: ``default``): a positive integer, never coerced."""
    if size is None:
        return default
    if isinstance(size, (bool, np.bool_)) or not isinstance(size, (int, np.integer)) or size < 1:
        raise RequestError(f"{what} must be a positive integer, got {size!r}")
    return int(size)


class _IdBatch:
    """Named id lists gathered into one flat Python list, checked with builtins.

    No numpy call per request, and one conversion for the whole batch only when there is
    work: the checks of a small batch cost microseconds even with cold caches (a numpy
    call costs 10-30 us there), those of a large one (16k ids) about a millisecond.
    """

    def __init__(self) -> None:
        self.subjects: list[str] = []  # "request 'a'", or an argument's name
        self.lengths: list[int] = []
        self.flat: list[Any] = []

    def add(self, subject: str, ids: Any) -> None:
        if isinstance(ids, (np.ndarray, torch.Tensor)):
            if ids.ndim != 1:
                raise RequestError(f"{subject}: block ids must be a flat sequence, got shape {tuple(ids.shape)}")
            if not _integer_dtype(ids.dtype):
                raise RequestError(f"{subject}: block ids must be integers, got an array of {ids.dtype}")
            ids = ids.tolist()
        elif not isinstance(ids, (list, tuple, range)):
            # Sets and dict keys have no order, bytes and strings are not ids, an iterator
            # would be used up: none of them is read as block ids.
            raise RequestError(f"{subject}: block ids must be a {_ID_KINDS}, got {type(ids).__name__} {_short(ids)}")
        self.subjects.append(subject)
        self.lengths.append(len(ids))
        self.flat.extend(ids)

    def check(self, limit: int, *, what: str, unique: bool) -> None:
        """Raise unless every id is an integer in ``[0, limit)`` (and unique, if asked); bools are not ids."""
        flat = self.flat
        if not flat:
            return
        if not all(_integer_type(kind) for kind in set(map(type, flat))):
            position = next(i for i, x in enumerate(flat) if not _integer_type(type(x)))
            subject, at = self._where(position)
            raise RequestError(f"{subject}: block ids must be integers, got {flat[position]!r} at position {at}")
        if min(flat) < 0 or max(flat) >= limit:
            position = next(i for i, x in enumerate(flat) if not 0 <= x < limit)
            subject, at = self._where(position)
            raise RequestError(f"{subject}: {what} {flat[position]} at position {at} is out of range [0, {limit})")
        if unique and len(set(flat)) != len(flat):
            first_seen: dict[int, int] = {}
            for position, block in enumerate(flat):
                earlier = first_seen.setdefault(block, position)
                if earlier != position:
                    a, b = self._owner(earlier), self._owner(position)
                    if a == b:
                        raise RequestError(f"{self.subjects[a]}: block id {block} appears twice")
                    raise RequestError(f"block id {block} is claimed by {self.subjects[a]} and {self.subjects[b]}")

    def array(self) -> np.ndarray:
        """Every id, in order, as one int64 array (the batch's only numpy conversion)."""
        return np.array(self.flat, dtype=np.int64) if self.flat else np.zeros(0, dtype=np.int64)

    def _owner(self, position: int) -> int:
        return bisect.bisect_right(list(itertools.accumulate(self.lengths)), position)

    def _where(self, position: int) -> tuple[str, int]:
        """Who holds flat ``position``, and where in its own list."""
        owner = self._owner(position)
        return self.subjects[owner], position - sum(self.lengths[:owner])


def _integer_type(kind: type) -> bool:
    return issubclass(kind, (int, np.integer)) and not issubclass(kind, bool)


def _integer_dtype(dtype: np.dtype[Any] | torch.dtype) -> bool:
    if isinstance(dtype, torch.dtype):
        return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)
    return dtype.kind in "iu"


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
