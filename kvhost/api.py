"""The public calls: receive, copy_blocks, and KVHost for caches registered once."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np
import torch

from kvhost.backend import Backend, Completion
from kvhost.batch import CopyJob, Ids, Incoming, ReceiveBatch, ReceiveJob, plan_copy_batch, plan_receive_batch
from kvhost.caches import CacheSet, Layer, check_one_device
from kvhost.errors import (
    ArgumentError,
    BackendError,
    KVHostError,
    LayoutError,
    RequestError,
    brief,
    failure,
    shown,
    shown_name,
)
from kvhost.lru import LRU
from kvhost.registry import get_backend
from kvhost.stats import CopyResult, ReceiveStats

Requests = Mapping[str, Sequence[int] | np.ndarray | Incoming]
# Sets of some registered layers a KVHost keeps (``receive(layers=...)``): one per layer of
# the largest models, and a few more.
MAX_LAYER_SETS = 512
_Job = TypeVar("_Job", ReceiveJob, CopyJob)


def receive(
    caches: Mapping[str, Layer],
    requests: Requests,
    *,
    axes: str,
    remote_order: str | None = None,
    remote_block_size: int | None = None,
    backend: str | Backend | None = None,
) -> ReceiveStats:
    """Post-process, in place, the blocks of ``requests`` that hold the sender's wire bytes.

    ``requests`` maps a request id to its local block ids in token order, or to an
    ``Incoming`` naming its own remote order and block size, and how many of its tokens
    arrived (the rest of its blocks is zeroed). The whole batch is checked
    before any byte moves (a batch where none would move is only counted); requests
    sharing a transform are done in one backend call.
    """
    chosen = _backend(backend, _device_of(caches, axes, "caches"), (caches, "caches"))
    with _Exclusive(chosen):  # from the first read of a tensor's facts (XLA cannot read them mid-update)
        return _receive(CacheSet(caches, axes), requests, remote_order, remote_block_size, chosen)


def copy_blocks(
    src: Mapping[str, Layer],
    dst: Mapping[str, Layer],
    src_ids: Ids,
    dst_ids: Ids,
    *,
    axes: str,
    dst_axes: str | None = None,
    non_blocking: bool = False,
    backend: str | Backend | None = None,
) -> CopyResult:
    """Block ``dst_ids[i]`` of every layer of ``dst`` receives block ``src_ids[i]`` of ``src``.

    ``dst_axes`` names dst's dims when its layout differs (the copy rearranges on the
    way); devices may differ (host staging, either way).
    """
    dst_axes = axes if dst_axes is None else dst_axes
    device = _copy_device(_device_of(src, axes, "src"), _device_of(dst, dst_axes, "dst"))
    chosen = _backend(backend, device, (src, "src"), (dst, "dst"))
    with _Exclusive(chosen):
        source = CacheSet(src, axes, role="src")
        dest = CacheSet(dst, dst_axes, role="dst")
        return _copy(source, dest, src_ids, dst_ids, non_blocking, chosen)


class KVHost:
    """A set of caches registered once, as a connector holds them for its lifetime.

    Layouts are read once, and checked to be still in place on every call that moves
    bytes; two threads may work on disjoint blocks at once.
    """

    def __init__(self, caches: Mapping[str, Layer], *, axes: str, backend: str | Backend | None = None) -> None:
        self.backend = _backend(backend, _device_of(caches, axes, "caches"), (caches, "caches"))
        with _Exclusive(self.backend):
            self.caches = CacheSet(caches, axes)
        # The layers as given (a list's tensors as a tuple), to make sets of some of them.
        self._given = {name: tuple(layer) if isinstance(layer, list) else layer for name, layer in caches.items()}
        self._peers: LRU[tuple[int, str, str], CacheSet] = LRU(4)
        self._some_layers: LRU[tuple[str, ...], CacheSet] = LRU(MAX_LAYER_SETS)

    @property
    def device(self) -> torch.device:
        return self.caches.device

    def receive(
        self,
        requests: Requests,
        *,
        remote_order: str | None = None,
        remote_block_size: int | None = None,
        layers: Sequence[str] | None = None,
    ) -> ReceiveStats:
        """Like ``kvhost.receive`` on the registered caches (which must still be where they were).

        ``layers`` names the registered layers to post-process (default: every one): a
        layer can then be done as soon as its bytes have landed, while later layers are
        still arriving (``kvhost.nixl.Reader.read_layers``).
        """
        with _Exclusive(self.backend):
            if layers is None:
                return _receive(self.caches, requests, remote_order, remote_block_size, self.backend, registered=True)
            key, caches = self._layers(layers)
            stats = _receive(caches, requests, remote_order, remote_block_size, self.backend, registered=True)
            self._some_layers.put(key, caches)  # kept once a receive was planned with it: a refused call leaves nothing
            return stats

    def _layers(self, layers: Sequence[str]) -> tuple[tuple[str, ...], CacheSet]:
        """The registered layers ``layers`` names, as a set of their own, and its key: a set
        kept from an earlier receive, or one made now (kept by the caller once planned)."""
        if isinstance(layers, str) or not isinstance(layers, (list, tuple)):
            raise ArgumentError(f"layers must be a list or tuple of layer names, got {shown(layers)}")
        key = tuple(layers)
        try:
            known = self._some_layers.get(key)
        except TypeError:  # a name that is not even hashable: the checks below word it
            known = None
        if known is not None:
            return key, known
        if not key:
            raise ArgumentError("layers: name at least one layer (None: every layer)")
        for index, name in enumerate(key):
            if not isinstance(name, str) or name not in self._given:
                raise ArgumentError(
                    f"layers[{index}]: {shown_name(name)} is not a registered layer ({len(self._given)} are)"
                )
            if name in key[:index]:
                raise ArgumentError(f"layers[{index}]: {shown_name(name)} is named twice")
        # Made from the tensors as they are now: only while they are where they were registered.
        self.caches.check_current()
        return key, CacheSet({name: self._given[name] for name in key}, self.caches.axes)

    def copy_to(
        self,
        dst: Mapping[str, Layer],
        src_ids: Ids,
        dst_ids: Ids,
        *,
        dst_axes: str | None = None,
        non_blocking: bool = False,
    ) -> CopyResult:
        """Copy registered blocks ``src_ids`` out to ``dst`` (e.g. save to a host buffer)."""
        return self._copy_with(dst, dst_axes, "dst", src_ids, dst_ids, non_blocking)

    def copy_from(
        self,
        src: Mapping[str, Layer],
        src_ids: Ids,
        dst_ids: Ids,
        *,
        src_axes: str | None = None,
        non_blocking: bool = False,
    ) -> CopyResult:
        """Copy blocks ``src_ids`` of ``src`` into registered blocks ``dst_ids`` (a load)."""
        return self._copy_with(src, src_axes, "src", src_ids, dst_ids, non_blocking)

    def _copy_with(
        self, peer: Mapping[str, Layer], axes: str | None, role: str, src_ids: Ids, dst_ids: Ids, non_blocking: bool
    ) -> CopyResult:
        """A copy between the registered caches and ``peer``, the copy's ``role`` side.

        A connector's host buffer is allocated once and passed on every call; its layouts
        need not be read again. A few peers are remembered (and kept alive), each only once
        a copy with it was planned: a refused call leaves nothing behind.
        """
        axes = self.caches.axes if axes is None else axes
        backend = self._peer_backend(peer, axes, role)
        with _Exclusive(backend):
            self.caches.check_current()
            key = (id(peer), axes, role)
            known = self._peers.get(key) if isinstance(axes, str) else None  # other axes: the set words them
            peer_set = known if known is not None and known.describes(peer) else CacheSet(peer, axes, role=role)
            source, dest = (self.caches, peer_set) if role == "dst" else (peer_set, self.caches)
            result = _copy(source, dest, src_ids, dst_ids, non_blocking, backend)
            if peer_set is not known:
                self._peers.put(key, peer_set)
            return result

    def _peer_backend(self, caches: Mapping[str, Layer], axes: str, role: str) -> Backend:
        """The backend a copy with ``caches`` runs on: the registered one, unless the peer is
        the accelerator of a host cache. Chosen before the peer's tensors are read, so that
        its lock covers the reading."""
        first = _first_tensor(caches)
        if first is not None and first.is_cpu:  # the usual peer, a host buffer: no torch.device made (tens of us cold)
            return self.backend
        device = _device_of(caches, axes, role)
        if device.type == self.device.type:
            return self.backend
        return _backend(None, _copy_device(self.device, device))


def _receive(
    caches: CacheSet,
    requests: Requests,
    remote_order: str | None,
    remote_block_size: int | None,
    backend: Backend,
    *,
    registered: bool = False,
) -> ReceiveStats:
    start = time.perf_counter()
    batch = plan_receive_batch(caches, requests, remote_order, remote_block_size)
    if registered and (batch.jobs or batch.zero_jobs):  # bytes will move: the caches must still be where they were
        caches.check_current()
    for job in batch.jobs:  # all of them before any byte moves
        _check(backend, backend.check_receive, job)
    ran = 0
    try:
        for job in batch.jobs:
            backend.receive(job)
            ran += 1
        for zero in batch.zero_jobs:  # after the rearrangement: a block partly received is rearranged, then cut
            backend.zero(zero)
    except Exception as err:
        if ran == 0 and isinstance(err, KVHostError):
            raise  # the backend's own error, before any job of this call had run
        raise BackendError(_receive_failed(backend, batch, ran, err)) from err
    return ReceiveStats(
        blocks=batch.blocks,
        bytes_moved=batch.bytes_moved,
        groups=batch.groups,
        backend=backend.name,
        requests=batch.requests,
        skipped_blocks=batch.skipped_blocks,
        zeroed_blocks=batch.zeroed_blocks,
        seconds=time.perf_counter() - start,
    )


def _copy(
    source: CacheSet, dest: CacheSet, src_ids: Ids, dst_ids: Ids, non_blocking: bool, backend: Backend
) -> CopyResult:
    if not isinstance(non_blocking, bool):
        raise RequestError(f"non_blocking must be True or False, got {shown(non_blocking)}")
    if source.device.type == "meta" != dest.device.type:  # meta to meta moves nothing, as it should
        raise LayoutError(
            f"src layer {next(iter(source.layers))!r} is on meta: it has no bytes to copy to {dest.device.type}"
        )
    batch = plan_copy_batch(source, dest, src_ids, dst_ids, non_blocking)
    for job in batch.jobs:  # every refusal known in advance, before any job writes
        _check(backend, backend.check_copy, job)
    completions: list[Completion] = []
    try:
        for job in batch.jobs:
            completions.append(_completion(backend, backend.copy(job)))
    except Exception as err:
        for issued in completions:  # what they hold is let go of once they are done, without a warning
            with contextlib.suppress(Exception):
                issued.wait()
        if not completions and isinstance(err, KVHostError):
            raise  # the backend's own error, before any job of this call had run
        raise BackendError(
            f"backend {backend.name!r} failed in job {len(completions) + 1} of {len(batch.jobs)} of a copy: "
            f"{brief(err)}; the jobs before it were done (a copy retried moves the "
            "same bytes again)"
        ) from err
    return CopyResult(
        blocks=batch.blocks,
        bytes_moved=batch.bytes_moved,
        backend=backend.name,
        completion=completions[0] if len(completions) == 1 else _AllOf(completions),
        job=batch.jobs[0] if batch.jobs else None,
    )


def _check(backend: Backend, check: Callable[[_Job], None], job: _Job) -> None:
    """A backend's check of a job, before any byte moves: whatever it raises is a refusal,
    a KVHostError (a plugin's own exception becomes a BackendError naming it)."""
    try:
        check(job)
    except KVHostError:
        raise
    except Exception as err:
        raise _refusal(backend, f"{check.__name__} failed", err) from err


def _receive_failed(backend: Backend, batch: ReceiveBatch, ran: int, err: Exception) -> str:
    """What a receive that failed while its jobs ran left behind: a request rearranged must
    not be received again (a second rearrangement scrambles it), so the message says which."""
    jobs = batch.jobs

    def which(first: int, end: int) -> str:
        subjects = list(dict.fromkeys(s for of_job in batch.subjects_of_jobs[first:end] for s in of_job))
        layers = list(dict.fromkeys(m.layer for job in jobs[first:end] for m in job.members))
        more = f" and {len(subjects) - 8} more" if len(subjects) > 8 else ""
        return f"{', '.join(subjects[:8])}{more} (layers {shown(layers, 120)})"

    if ran == len(jobs):
        return (
            f"backend {backend.name!r} failed zeroing the ends of blocks that arrived in part: {brief(err)}; "
            "every block that needed rearranging was rearranged before it"
        )
    done = f"{which(ran, ran + 1)} may be rearranged in part"
    if ran:
        done = f"{which(0, ran)} were rearranged before it (do not receive them again); {done}"
    return f"backend {backend.name!r} failed in job {ran + 1} of {len(jobs)} of a receive: {brief(err)}; {done}"


def _refusal(backend: Backend, what: str, err: Exception) -> BackendError:
    """A plugin's own exception where no byte has moved yet, as the refusal it is."""
    return BackendError(f"backend {backend.name!r}: {what} (nothing was moved): {failure(err)}")


class _Exclusive:
    """``backend.exclusive()`` held around a call. A lock the backend cannot give (its
    ``exclusive`` raises, or returns no context manager, or entering it raises) is a
    BackendError naming it: nothing was read or moved yet. What the work raises inside, and
    the lock's own exit, pass through as they are."""

    __slots__ = ("backend", "lock")

    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    def __enter__(self) -> None:
        try:
            self.lock = self.backend.exclusive()
            type(self.lock).__enter__(self.lock)  # as ``with`` looks it up: on the type
        except KVHostError:
            raise
        except Exception as err:
            raise _refusal(self.backend, "exclusive() gave no lock to hold", err) from err

    def __exit__(self, *exc: Any) -> bool | None:
        return type(self.lock).__exit__(self.lock, *exc)


def _completion(backend: Backend, completion: object) -> Completion:
    """A backend's copy must say when it is done; anything else (a plugin's copy that
    returns None) is refused now, not found out at the caller's ``wait()``."""
    if not isinstance(completion, Completion):
        raise BackendError(
            f"backend {backend.name!r}: copy returned {type(completion).__name__}, not a kvhost Completion "
            "(the copy was issued: its bytes may have moved)"
        )
    return completion


class _AllOf(Completion):
    def __init__(self, parts: list[Completion]) -> None:
        self.parts = parts

    def done(self) -> bool:
        return all(part.done() for part in self.parts)

    def wait(self) -> None:
        for part in self.parts:
            part.wait()


def _device_of(caches: Mapping[str, Layer], axes: str, role: str) -> torch.device:
    """The device of the first tensor of ``caches``, looked at without reading any tensor's
    memory facts, so that a backend (and its lock) can be chosen first. Where there is no
    first tensor, the set is read to say what is wrong with it (CacheSet checks that every
    tensor shares that device)."""
    first = _first_tensor(caches)
    return first.device if first is not None else CacheSet(caches, axes, role=role).device


def _first_tensor(caches: Mapping[str, Layer]) -> torch.Tensor | None:
    """The first tensor of the first layer, unread; None where ``caches`` has none there."""
    if (type(caches) is dict or isinstance(caches, Mapping)) and caches:  # a dict skips the ABC's check
        layer = next(iter(caches.values()))
        first = layer[0] if isinstance(layer, (tuple, list)) and layer else layer
        if isinstance(first, torch.Tensor):
            return first
    return None


def _copy_device(src: torch.device, dst: torch.device) -> torch.device:
    """The device whose backend runs a copy: the accelerator side, when one side is the host."""
    if src.type == "cpu":
        return dst
    if dst.type in ("cpu", src.type):
        return src
    raise LayoutError(f"cannot copy between {src} and {dst}: stage through host memory")


def _backend(backend: str | Backend | None, device: torch.device, *sets: tuple[Mapping[str, Layer], str]) -> Backend:
    """The backend asked for: an instance (used as given), a name, or None (chosen by
    device, that of the first tensor of ``sets``: each a layer dict and its role)."""
    if isinstance(backend, Backend):
        return backend
    if backend is not None and not isinstance(backend, str):
        raise BackendError(f"backend must be a name, a kvhost.Backend or None, got {shown(backend)}")
    try:
        return get_backend(device, backend)
    except BackendError:
        for caches, role in sets:  # layers on several devices: what to name, before the backend
            check_one_device(caches, role)
        raise
