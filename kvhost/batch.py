"""The coalescing front end: a whole batch of requests becomes one piece of work per group.

It validates everything before any byte moves (ids in range, no id claimed twice, whole
groups, letters), groups requests by transform key, concatenates each group's ids once
with numpy (no per-request torch calls), drops groups whose transform changes nothing,
and hands each remaining group to the backend as a ReceiveJob. Copies become a CopyJob
with the contiguous runs of ids found once.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import torch

from kvhost.caches import CacheSet, CopyGroup, Member, MemberList, ReceiveGroup
from kvhost.errors import ArgumentError, KVHostError, RequestError, shown, shown_name
from kvhost.ids import IdBatch, Ids, find_runs, integer_value
from kvhost.layout import Layout, checked_letters
from kvhost.memory import first_shared
from kvhost.transform import CopyPlan, Rearrangement, block_ratio

__all__ = [
    "CopyBatch",
    "CopyJob",
    "Ids",
    "Incoming",
    "ReceiveBatch",
    "ReceiveJob",
    "ZeroJob",
    "plan_copy_batch",
    "plan_receive_batch",
]


@dataclass(frozen=True)
class Incoming:
    """A finished request: its local block ids in token order, and the sender's layout.

    ``remote_order`` and ``remote_block_size`` default to the call's values, and those to
    the local ones: the block size, and each layout's own region order (a sender laid out
    like the caches, whose layers may differ in strides). ``tokens``, when given, is how many of the
    request's tokens arrived: sender blocks that hold none of them are not rearranged,
    and every token from ``tokens`` on, to the end of the request's blocks, is zeroed
    (what vLLM does to a prompt that does not end on a block boundary).
    """

    block_ids: Sequence[int] | np.ndarray
    remote_order: str | None = None
    remote_block_size: int | None = None
    tokens: int | None = None


@dataclass(eq=False)  # a job is one call's work, equal to itself alone (its ids are an array)
class ReceiveJob:
    """One transform group for one layout: what a backend runs in a single call.

    ``unit_ids[u]`` are the local blocks of unit ``u`` (``rearrangement.parts`` of them);
    every outer index of every member tensor is rearranged for every unit. ``derived`` is
    where a backend keeps what it works out for this call alone (in ``check_receive``, for
    its ``receive``); it goes with the job.
    """

    group: ReceiveGroup
    unit_ids: np.ndarray
    device: torch.device
    derived: dict[str, object] = field(default_factory=dict, repr=False)
    # What a backend keeps for all the jobs of one call (one dict for them all): a scratch
    # they take in turn, made in their checks as large as the largest needs.
    shared: dict[object, object] = field(default_factory=dict, repr=False)

    @property
    def members(self) -> MemberList:
        return self.group.members

    @property
    def layout(self) -> Layout:
        return self.group.layout

    @property
    def rearrangement(self) -> Rearrangement:
        return self.group.rearrangement

    @property
    def bytes_moved(self) -> int:
        return int(self.unit_ids.shape[0]) * self.group.unit_bytes


@dataclass
class ZeroJob:
    """Tokens to zero after a receive, for one layout: every token of ``whole_ids``, and
    tokens ``partial_from[i]`` to the end of the block of ``partial_ids[i]``; in every
    outer index of every member tensor."""

    members: MemberList
    layout: Layout
    whole_ids: np.ndarray
    partial_ids: np.ndarray
    partial_from: np.ndarray
    device: torch.device

    @property
    def blocks(self) -> int:
        return int(self.whole_ids.size + self.partial_ids.size)


@dataclass
class ReceiveBatch:
    """The validated batch: the jobs to run and what they amount to.

    ``zero_jobs`` run after ``jobs``: a block partly received is rearranged, then its
    tail is zeroed.
    """

    jobs: list[ReceiveJob]
    requests: int
    blocks: int
    groups: int  # transform groups with work to do
    skipped_blocks: int  # blocks whose transform is the identity: nothing copied
    zero_jobs: list[ZeroJob] = field(default_factory=list)
    # The requests of each job, for the message of a job that fails: kept here, since
    # backends see blocks, never requests.
    subjects_of_jobs: list[Sequence[str]] = field(default_factory=list)

    @property
    def zeroed_blocks(self) -> int:
        return self.zero_jobs[0].blocks if self.zero_jobs else 0

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
    if type(requests) is not dict and not isinstance(requests, Mapping):  # a dict skips the ABC's slower check
        raise RequestError(f"requests must be a mapping of request id to block ids, got {type(requests).__name__}")
    local = caches.layout
    call_key = (
        _remote_order(remote_order, None, "remote_order"),  # None: each layout's own (a sender laid out like us)
        _remote_block_size(remote_block_size, local.block_size, "remote_block_size"),
    )
    try:
        call_groups: tuple[ReceiveGroup, ...] | None = caches.receive_groups(*call_key)
    except KVHostError:
        call_groups = None  # the checked path words the error, naming a request
    if call_groups == ():
        counted = _identity_batch(requests, block_ratio(local.block_size, call_key[1])[1])
        if counted is not None:
            return counted
    batch, key_list, key_of_request, arrived = _read_requests(caches, requests, call_key)
    if call_groups is None:  # the call's own spec is refused as such, whether or not a request takes it
        try:
            caches.receive_groups(*call_key)
        except KVHostError as err:
            call = f"remote_order {shown(remote_order)}, remote_block_size {shown(remote_block_size)}"
            raise ArgumentError(f"{call}: {err}") from None

    # The planner validates letters and sizes, for each layout (once per key: the cache set keeps its plans).
    groups_of_key: list[tuple[ReceiveGroup, ...]] = []
    for k, key in enumerate(key_list):
        try:
            groups_of_key.append(caches.receive_groups(*key))
        except KVHostError as err:
            raise RequestError(f"{batch.subjects[key_of_request.index(k)]}: {err}") from None

    # Whole groups are owed even when the transform is the identity: a sender block spans g.
    parts = [block_ratio(local.block_size, size)[1] for _, size in key_list]  # g of each key: planned, so it divides
    if max(parts, default=1) > 1:
        for subject, length, k in zip(batch.subjects, batch.lengths, key_of_request):
            if length % parts[k]:
                raise RequestError(
                    f"{subject}: {length} block ids are not whole groups of {parts[k]} "
                    f"(remote block size {key_list[k][1]} = {parts[k]} x local block size {local.block_size})"
                )

    partial = _Partial(arrived, batch, key_of_request, parts, local.block_size) if arrived else None
    return _receive_jobs(caches, batch, key_of_request, groups_of_key, partial)


def _identity_batch(requests: Mapping[str, Sequence[int] | Incoming | np.ndarray], owed: int) -> ReceiveBatch | None:
    """The batch of a call whose transform is the identity, counted without reading an id,
    where every request takes the call's transform; None where the checked path must look.

    Only the names and id containers are looked at: an Incoming, a tensor or anything odd
    takes the checked path, and so does a container this cannot count, or a count that is
    not whole groups of ``owed`` (the ids a sender block spans): it words the error.
    """
    kinds = set(map(type, requests.values()))
    if kinds <= _PLAIN_ID_LISTS and set(map(type, requests)) <= _STR:
        counts = _plain_counts(requests.values(), kinds)  # type: ignore[arg-type]  # no Incoming: just checked
        if counts is not None and (owed <= 1 or not any(count % owed for count in counts)):
            blocks = sum(counts)
            return ReceiveBatch([], requests=len(requests), blocks=blocks, groups=0, skipped_blocks=blocks)
    return None


def _read_requests(
    caches: CacheSet,
    requests: Mapping[str, Sequence[int] | Incoming | np.ndarray],
    call_key: tuple[str | None, int],
) -> tuple[IdBatch, list[tuple[str | None, int]], list[int], dict[int, int]]:
    """Every request's ids, checked as one batch, and its transform key: (the ids, the keys
    in the order first met, each request's index into them, and the tokens that arrived by
    request index, for the requests that say)."""
    batch = IdBatch(caches.num_blocks)
    keys: dict[tuple[str | None, int], int] = {}  # (remote order, None: each layout's own; block size)
    key_of_request: list[int] = []
    arrived: dict[int, int] = {}  # request index -> tokens that arrived, for requests that say
    for name, request in requests.items():
        if not isinstance(name, str):
            raise RequestError(f"request ids must be strings, got {shown(name)} ({type(name).__name__})")
        subject = f"request {shown_name(name)}"
        if isinstance(request, Incoming):
            key = (
                _remote_order(request.remote_order, call_key[0], f"{subject}: remote_order"),
                _remote_block_size(request.remote_block_size, call_key[1], f"{subject}: remote_block_size"),
            )
            if request.tokens is not None:
                arrived[len(key_of_request)] = _tokens(request.tokens, f"{subject}: tokens")
            batch.add(subject, request.block_ids)
        else:
            key = call_key
            batch.add(subject, request)
        key_of_request.append(keys.setdefault(key, len(keys)))
    batch.check()
    return batch, list(keys), key_of_request, arrived


def _receive_jobs(
    caches: CacheSet,
    batch: IdBatch,
    key_of_request: list[int],
    groups_of_key: list[tuple[ReceiveGroup, ...]],
    partial: _Partial | None,
) -> ReceiveBatch:
    """The checked batch as jobs: for each transform key with work, its requests' ids (those
    that arrived) in one array, one job per layout group; then the zeroing of the tails."""
    jobs: list[ReceiveJob] = []
    subjects_of_jobs: list[Sequence[str]] = []
    shared: dict[object, object] = {}
    groups = skipped = 0
    with_work = [k for k, planned in enumerate(groups_of_key) if planned]
    ids = batch.array() if with_work or partial else None
    request_key = np.repeat(np.array(key_of_request), batch.lengths) if len(groups_of_key) > 1 and with_work else None
    for k in range(len(groups_of_key)):
        if k not in with_work:
            skipped += sum(length for length, key in zip(batch.lengths, key_of_request) if key == k)
            continue
        assert ids is not None
        wanted = None if request_key is None else request_key == k
        if partial is not None:  # blocks that received nothing are zeroed, not rearranged
            wanted = partial.arrived if wanted is None else wanted & partial.arrived
        group_ids = ids if wanted is None else ids[wanted]
        if not group_ids.size:
            continue
        groups += 1
        subjects = (
            batch.subjects if request_key is None else [s for s, key in zip(batch.subjects, key_of_request) if key == k]
        )
        for group in groups_of_key[k]:
            unit_ids = group_ids.reshape(-1, group.rearrangement.parts)
            jobs.append(ReceiveJob(group, unit_ids, caches.device, shared=shared))
            subjects_of_jobs.append(subjects)
    zero_jobs = []
    if partial is not None and partial.blocks:
        assert ids is not None
        whole, partial_ids, partial_from = partial.zero(ids)
        for layout, members in caches.by_layout():
            zero_jobs.append(ZeroJob(members, layout, whole, partial_ids, partial_from, caches.device))
    return ReceiveBatch(
        jobs,
        requests=len(batch.subjects),
        blocks=len(batch.flat),
        groups=groups,
        skipped_blocks=skipped,
        zero_jobs=zero_jobs,
        subjects_of_jobs=subjects_of_jobs,
    )


class _Partial:
    """Where the requests that name ``tokens`` end: which of their blocks hold wire bytes
    to rearrange, and which tokens to zero.

    A request's sender blocks arrive whole, so the unit holding its last token is
    rearranged whole; units after it received nothing and are left alone. Then every
    token from ``tokens`` on is zeroed: the rest of the block holding the last token, and
    every later block the request names.
    """

    def __init__(
        self, arrived: dict[int, int], batch: IdBatch, key_of_request: list[int], parts: list[int], block_size: int
    ) -> None:
        starts = np.concatenate(([0], np.cumsum(batch.lengths, dtype=np.int64)))
        self.arrived = np.ones(int(starts[-1]), dtype=bool)  # per position: rearranged
        self._whole: list[tuple[int, int]] = []  # position ranges zeroed whole
        self._partial: list[tuple[int, int]] = []  # (position, first token zeroed)
        for index, tokens in arrived.items():
            start, length, unit = int(starts[index]), batch.lengths[index], parts[key_of_request[index]]
            subject = batch.subjects[index]
            if tokens > length * block_size:
                raise RequestError(
                    f"{subject}: tokens={tokens} do not fit in the {length} block ids named "
                    f"({length} x {block_size} = {length * block_size} tokens)"
                )
            units = -(-tokens // (unit * block_size))
            self.arrived[start + units * unit : start + length] = False
            last, used = divmod(tokens - 1, block_size)
            if used + 1 < block_size:
                self._partial.append((start + last, used + 1))
            self._whole.append((start + last + 1, start + length))  # empty where the last token is in the last block
        self.blocks = len(self._partial) + sum(end - begin for begin, end in self._whole)

    def zero(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(blocks zeroed whole, blocks zeroed from a token on, that token) as block ids."""
        return (  # one range of whole blocks per request (made only for requests with tokens), some empty
            np.concatenate([ids[begin:end] for begin, end in self._whole]).astype(np.int64, copy=False),
            ids[[p for p, _ in self._partial]].astype(np.int64, copy=False),  # ids[[]]: empty, of ids' dtype
            np.array([t for _, t in self._partial], dtype=np.int64),
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
        return self.src_ids.size * self.group.block_bytes


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
    sources = IdBatch(src.num_blocks, what="source block id", unique=False)
    dests = IdBatch(dst.num_blocks, what="destination block id")
    sources.add("src_ids", src_ids)
    dests.add("dst_ids", dst_ids)
    if len(sources.flat) != len(dests.flat):
        raise RequestError(f"src_ids has {len(sources.flat)} ids but dst_ids has {len(dests.flat)}")
    sources.check()
    dests.check()
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


_PLAIN_ID_LISTS = {list, tuple, range, np.ndarray}
_LISTS = {list, tuple}  # plain id containers whose len() is their count, never refused
_STR = {str}


def _plain_counts(containers: Iterable[Sequence[int] | np.ndarray], kinds: set[type]) -> list[int] | None:
    """How many ids each container of ``_PLAIN_ID_LISTS`` holds (``kinds``: their types), or
    None where one cannot be counted as a list of ids (``_plain_count``)."""
    if kinds <= _LISTS:
        return list(map(len, containers))  # lists and tuples: len() at C speed
    counts = list(map(_plain_count, containers))
    return None if None in counts else counts  # type: ignore[return-value]  # no None: just checked


def _plain_count(ids: Sequence[int] | np.ndarray) -> int | None:
    """How many ids a container of ``_PLAIN_ID_LISTS`` holds, or None for one that cannot be
    a list of ids (an array not flat or not of integers) or counted (a range past ``len``)."""
    if type(ids) is np.ndarray:
        return ids.size if ids.ndim == 1 and ids.dtype.kind in "iu" else None
    try:
        return len(ids)
    except OverflowError:
        return None


def _remote_order(order: object, default: str | None, what: str) -> str | None:
    """A sender's region order as given (None: ``default``); anything but letters is refused."""
    if order is None:
        return default
    return checked_letters(order, what=what, error=RequestError)


def _tokens(tokens: object, what: str) -> int:
    """A request's count of tokens that arrived: a positive integer, never coerced."""
    value = integer_value(tokens)
    if value is None or value < 1:
        raise RequestError(f"{what} must be a positive integer, got {shown(tokens)}")
    return value


def _remote_block_size(size: object, default: int, what: str) -> int:
    """A sender's tokens per block as given (None: ``default``): a positive integer, never coerced."""
    if size is None:
        return default
    if type(size) is int and size > 0:  # the common case, with no look-up of numpy's types
        return size
    value = integer_value(size)
    if value is None or value < 1:
        raise RequestError(f"{what} must be a positive integer, got {shown(size)}")
    return value
