"""The coalescing front end: a whole batch of requests becomes one piece of work per group.

It validates everything before any byte moves (ids in range, no id claimed twice, whole
groups, letters), groups requests by transform key, concatenates each group's ids once
with numpy (no per-request torch calls), drops groups whose transform changes nothing,
and hands each remaining group to the backend as a ReceiveJob. Copies become a CopyJob
with the contiguous runs of ids found once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np
import torch

from kvhost.caches import CacheSet, CopyGroup, Member, MemberList
from kvhost.errors import KVHostError, RequestError
from kvhost.ids import IdBatch, Ids, find_runs
from kvhost.layout import Layout, check_letters
from kvhost.memory import first_shared
from kvhost.transform import CopyPlan, Rearrangement, plan_receive

__all__ = [
    "CopyBatch",
    "CopyJob",
    "Ids",
    "Incoming",
    "ReceiveBatch",
    "ReceiveJob",
    "plan_copy_batch",
    "plan_receive_batch",
]


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
    batch = IdBatch()
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
                jobs.append(ReceiveJob(members, layout, plan, group_ids.reshape(-1, plan.parts), caches.device))
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


def plan_copy_batch(
    src: CacheSet,
    dst: CacheSet,
    src_ids: Ids,
    dst_ids: Ids,
    non_blocking: bool,
) -> CopyBatch:
    """Validate a copy and hand each group of member pairs that share a plan to one job."""
    copy_groups = src.copy_groups(dst)
    sources, dests = IdBatch(), IdBatch()
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
