"""The accelerator backend that CUDA and XPU share: Triton kernels or torch ops, staged host copies.

One class serves both devices; ``CudaBackend`` and ``XpuBackend`` only name their device
and the Triton compiler that targets it. Everything device-specific goes through
``DeviceRuntime`` (torch's device-generic streams and events).

- Receive runs on the caller's current stream: one Triton launch per job (every layer of
  the group at once; one per round where a job is split in rounds), or the torch path's
  gather -> permute -> scatter where Triton is not usable here. No host round trip:
  addresses and ids go up in one non-blocking copy from pinned memory. Before any job of
  a call launches, every job's tables and scratch are made and its kernels compiled and
  loaded (``check_receive``), so neither a device out of memory nor a kernel that cannot
  compile or load leaves a call half rearranged.
- Copies run on a side stream that first waits for the caller's stream, and
  complete through an event. Contiguous runs with the same block bytes on both sides are
  one ``copy_(non_blocking=True)`` each (the *direct* way). Otherwise a host <-> device
  copy is *staged*: the device side is gathered or scattered on the device into a compact
  staging buffer in the host's letters, which crosses the bus as one copy per run of host
  ids where those are few (*host spans*), or else as one copy to or from a pinned bounce
  buffer, the CPU backend moving the host side between the bounce buffer and the host
  blocks (for a save, once the event has fired: on ``done()``/``wait()``). ``copy_host``
  chooses.

Streams and lifetimes, the contract:

- A receive is ordered like any kernel the caller queues on its current stream, and
  returns without waiting. Its id tables and scratch are made on that stream and dropped
  after the launch: the caching allocator hands a freed block only to later work on the
  same stream, and the pinned staging of the tables only after the copy that reads it.
- A copy runs on the device's side stream, which first waits for the caller's current
  stream: it sees everything queued before the call. The caller's stream does not wait
  for it (that is what lets an offload overlap the next step's compute). With
  ``non_blocking=False`` the call returns once the bytes are in place. With
  ``non_blocking=True``, until the result's ``done()`` is True or ``wait()`` returns, no
  stream may write the source blocks or touch the destination blocks, and the bytes of a
  staged save reach the host only then.
- The result (``kvhost.backend.EventCompletion``, shared with the torch path) keeps every
  buffer the copy uses alive until the copy is complete: the caller's tensors, staging and
  bounce buffers, id tables. A result
  dropped earlier completes itself first (waits for its event, runs the host step) and
  warns: no buffer is released while a stream still uses it, and no save is lost.
- The torch path's reused id buffers are per thread and stream (``IndexBuffers``): one
  stream never refills or frees the buffer another stream may still be reading.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import sysconfig
from collections.abc import Callable, Iterator
from dataclasses import replace
from functools import cached_property
from types import ModuleType
from typing import Any, ClassVar, NamedTuple

import numpy as np
import torch
from kvhost_torch.backend import TorchBackend, call_scratch

from kvhost.backend import Backend, Completion, EventCompletion, OptionalKernels, next_power_of_two
from kvhost.batch import CopyJob, ReceiveJob
from kvhost.caches import CopyGroup, Member
from kvhost.errors import BackendError, brief, first_line
from kvhost.ids import find_runs
from kvhost.layout import Layout
from kvhost.memory import byte_extent
from kvhost.transform import plan_copy
from kvhost_accelerator.launch import Limits, plan_copy_launch, plan_receive_launch
from kvhost_accelerator.runtime import DeviceRuntime

TRITON_KERNELS = OptionalKernels("kvhost_accelerator.kernels")  # imported on first use only


def load_kernels() -> ModuleType | None:
    """The Triton kernels module, or None where it cannot be imported (``unloaded_reason`` says why)."""
    return TRITON_KERNELS.module


def unloaded_reason() -> str:
    """Why ``load_kernels`` gives None: triton missing, or what its import raised."""
    reason = TRITON_KERNELS.reason
    return (
        "triton is not installed"
        if reason == "No module named 'triton'"
        else f"the Triton kernels cannot load: {reason}"
    )


class AcceleratorBackend(Backend):
    """Receive and copies on one accelerator type through torch's device-generic calls.

    Subclasses set ``name`` and ``device_types`` and say which Triton compiler backends
    target the device; nothing else differs between devices. Where the kernels cannot run
    (``kernels_missing`` says why), the torch path does the work.
    """

    priority = 10
    max_run_copies: ClassVar[int] = 64  # on the device: direct copy_ calls at most; beyond, one kernel
    max_host_copies: ClassVar[int] = 64  # across the bus: copy_ calls at most, unless each is large:
    direct_span_bytes: ClassVar[int] = 512 << 10  # a host copy this large is worth its own call
    limits: ClassVar[Limits] = Limits(scratch_most_bytes=256 << 20)  # launch.py: why slots may outgrow L2
    programs_per_processor: ClassVar[int] = 4

    def __init__(self, *, use_triton: bool = True) -> None:
        self.use_triton = use_triton
        # The torch path on the device: bounded temporaries, one copy_ per run up to max_run_copies.
        self.torch_path = TorchBackend(device_chunk_bytes=64 << 20, max_run_copies=self.max_run_copies)
        # limits_for's answers: device -> (the limits it was derived from, the answer).
        self._device_limits: dict[torch.device, tuple[Limits, Limits]] = {}
        # (device, KernelCall.compile_key()) of every kernel compiled and loaded for a receive.
        self._compiled: set[tuple[Any, ...]] = set()

    def triton_compilers(self) -> tuple[str, ...]:
        """Names of the Triton compiler backends (``triton.backends``) that target this device."""
        raise NotImplementedError

    @cached_property
    def runtime(self) -> DeviceRuntime:
        return DeviceRuntime(self.device_types[0])

    @cached_property
    def host(self) -> Backend:
        """The backend that moves host-side bytes of a staged copy: the CPU backend."""
        from kvhost_cpu import CpuBackend

        return CpuBackend()

    @cached_property
    def kernels(self) -> ModuleType | None:
        """The Triton kernels when this device runs them (else ``kernels_missing`` says why)."""
        return None if self.kernels_missing else load_kernels()

    @cached_property
    def kernels_missing(self) -> str:
        """Why the torch path runs instead of the kernels; empty when they run."""
        if not self.use_triton:
            return "Triton switched off"
        kernels = load_kernels()
        if kernels is None:
            return unloaded_reason()
        if kernels.interpreted():
            return "TRITON_INTERPRET=1 is set: interpreted kernels cannot reach device memory"
        if (old := kernels.too_old()) is not None:
            return str(old)
        compilers, wanted = kernels.compiler_targets(), self.triton_compilers()
        if not set(wanted) & set(compilers):
            return f"triton here compiles for {', '.join(compilers)}, not {' or '.join(wanted)}"
        return launcher_build_missing() or self._probe(kernels)

    def _probe(self, kernels: ModuleType) -> str:
        """Why Triton cannot build and load a kernel on this device type's current device, or
        '' where it can (or no device is here to try it on): a machine short of what Triton
        needs (the driver's library where Triton looks for it, a compiler) gets the torch
        path, not a receive that fails at every call."""
        device_type = self.device_types[0]
        if not self.runtime.module.is_available():
            return ""
        device = torch.device(device_type, self.runtime.index(torch.device(device_type)))
        try:
            with self.runtime.guard(device):
                kernels.probe(device)
        except Exception as err:  # Triton's build, load and driver errors have no common base
            return f"Triton cannot build or load a kernel on {device}: {brief(err)}"
        return ""

    def describe(self) -> str:
        path = "Triton kernels" if self.kernels is not None else f"torch ops ({self.kernels_missing})"
        if self.kernels is not None and not self.barrier_orders_global_memory():
            path += " (every receive in two launches: this Triton's barrier does not fence global memory)"
        return f"receive and scattered copies: {path}; host copies: pinned staging on a side stream, events"

    def barrier_orders_global_memory(self) -> bool:
        """Whether ``tl.debug_barrier`` orders global memory between the threads of a program.

        The receive's registers and slots modes exchange words through global memory across
        it. True for NVIDIA (``bar.sync``) and AMD (workgroup-scope fences for every
        address space), checked on the compiled code by ``tests/test_triton_compile.py``.
        Where it is False every receive is split: the kernel boundary is the barrier.
        """
        return True

    def limits_for(self, device: torch.device) -> Limits:
        """``limits`` fitted to ``device``: made once per device (on an H200 making them took
        8% of a one-request receive's host time), again if ``limits`` is replaced."""
        known = self._device_limits.get(device)
        if known is not None and known[0] is self.limits:
            return known[1]
        processors = self.runtime.processors(device)
        programs = min(self.limits.programs, processors * self.programs_per_processor)
        barrier = self.limits.barrier and self.barrier_orders_global_memory()
        fitted = replace(self.limits, programs=programs, processors=processors, barrier=barrier)
        self._device_limits[device] = (self.limits, fitted)
        return fitted

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """Around a call: a call while the stream captures a graph is refused, since a replay
        would run launches whose tables and scratch, and copies whose staging buffers, the
        call let go of when it ended."""
        if self.runtime.capturing():
            raise BackendError(
                f"backend {self.name!r}: called while the current stream captures a graph; kvhost's calls "
                "free their tables and buffers when they end, so a replay would use freed memory: call it outside"
            )
        yield

    # --- receive -------------------------------------------------------------------------

    def check_receive(self, job: ReceiveJob) -> None:
        if self.kernels is not None:
            # What the kernels cannot index is refused here, and what the launches need (the
            # tables on the device, the scratch) is made here: called for every job of a
            # call before any runs, so a device short of memory for one job's scratch (a
            # cache sized to fill the device) leaves the call unwritten, not half rearranged.
            job.derived["accelerator"] = self._prepare_receive(job)
        else:
            self.torch_path.check_receive(job)

    def _prepare_receive(self, job: ReceiveJob) -> _PreparedReceive:
        layout = job.layout
        bases = np.array([m.tensor.data_ptr() for m in job.members], dtype=np.int64)
        outer = layout.outer_offsets_bytes
        alignment = int(np.bitwise_or.reduce(np.concatenate([bases, outer]))) | layout.block_stride_bytes
        launch = plan_receive_launch(
            job.rearrangement,
            members=bases.size,
            outer=outer.size,
            units=int(job.unit_ids.shape[0]),
            alignment=alignment,
            limits=self.limits_for(job.device),
        )
        kernels = self.kernels
        assert kernels is not None  # only with kernels
        with self.runtime.guard(job.device):
            # Made on the current stream, the one the kernels run on (the same call's): a
            # device block freed without record_stream goes only to later allocations on its
            # own stream, whose work queues behind the kernels, so dropping these with the
            # job is safe. The pinned staging buffer: a non-blocking copy records an event
            # for it, and the caching host allocator hands it out again only after.
            keep: list[torch.Tensor] = []
            try:
                base_table, outer_table, ids = self._upload([bases, outer, job.unit_ids.ravel()], job.device, keep)
                # The call's jobs launch in turn on one stream, so they share one scratch.
                scratch = call_scratch(
                    job.shared,
                    "accelerator scratch",
                    job.device,
                    max(launch.scratch_words, 1),
                    kernels.TORCH_WORDS[launch.word_bytes],
                )
            except OUT_OF_MEMORY as err:  # refused before any byte moves: a smaller call may fit
                raise BackendError(
                    f"{job.device}: out of memory for a receive's tables and scratch "
                    f"({launch.scratch_words * launch.word_bytes} bytes of scratch): {first_line(err)}"
                ) from None
            keep.append(scratch)
        calls = kernels.receive_calls(
            launch,
            bases=base_table,
            outer_offsets=outer_table,
            ids=ids,
            scratch=scratch,
            units=int(job.unit_ids.shape[0]),
            block_stride=layout.block_stride_bytes,
        )
        self._compile(calls, job.device, "receive")
        return _PreparedReceive(calls, keep)

    def _compile(self, calls: list[Any], device: torch.device, what: str) -> None:
        """Compile every kernel ``calls`` launch, before any launches: a receive of several
        jobs (senders of several layouts) would otherwise compile the second job's kernel
        after the first was rearranged in place, and a kernel that fails to compile then
        leaves the call half done. Once per compiled kernel (``compile_key``), so a call
        whose kernels are known pays a dictionary lookup, not Triton's binding."""
        with self.runtime.guard(device):
            for call in calls:
                key = (device, call.compile_key())
                if key in self._compiled:
                    continue
                try:
                    self.compile(call)
                except Exception as err:  # Triton's compile and load errors have no common base
                    name = getattr(call.kernel, "__name__", type(call.kernel).__name__)
                    raise BackendError(
                        f"{device}: the kernel {name} for this {what} cannot run here: {brief(err)}"
                    ) from err
                self._compiled.add(key)

    def receive(self, job: ReceiveJob) -> None:
        if self.kernels is None:
            return self.torch_path.receive(job)
        prepared = job.derived.get("accelerator")
        if not isinstance(prepared, _PreparedReceive):  # a receive its check did not precede (called directly)
            prepared = self._prepare_receive(job)
        with self.runtime.guard(job.device):
            for call in prepared.calls:
                self.launch(call)
        return None

    def launch(self, call: Any) -> None:
        """Launch one kernel call (``kernels.KernelCall``) on the current stream and device."""
        call.launch()

    def compile(self, call: Any) -> None:
        """Compile and load one kernel call's kernel for the current device, launching nothing."""
        call.compile()

    # --- copies --------------------------------------------------------------------------

    def copy(self, job: CopyJob) -> Completion:
        src_device, dst_device = job.src_device, job.dst_device
        mine = self.device_types
        if src_device.type in mine and dst_device.type in mine and src_device != dst_device:
            return self._copy_between_devices(job)
        device = src_device if src_device.type in mine else dst_device
        runtime = self.runtime
        side = runtime.side_stream(device)
        runtime.wait(side, runtime.current_stream(device))  # read what the caller's stream wrote first
        keep: list[Any] = []
        finish = None
        with runtime.guard(device), runtime.using(side):
            if src_device == dst_device:
                self.copy_on_device(job, keep)
            else:
                finish = self.copy_host(job, to_device=dst_device == device, keep=keep)
            event = runtime.record(side)
        # The caller's tensors and their storages (a tensor re-pointed meanwhile would let go
        # of its old one) stay referenced until the copy is done (record_stream would fail
        # on memory the caching allocator did not hand out, such as imported buffers).
        keep += [m for pair in job.pairs for m in pair]
        completion = EventCompletion(event, keep, finish)
        if not job.non_blocking:
            completion.wait()
        return completion

    def copy_on_device(self, job: CopyJob, keep: list[Any]) -> None:
        """Both sides on this device, work issued on the current stream."""
        if self.direct_copies(job) <= self.max_run_copies:
            self.copy_direct(job)
            return
        kernels = self.kernels
        if kernels is None:
            # On this stream, in order: the caller's completion (an event on it) covers the copy,
            # and a side stream's completion of its own would be dropped here, waited for at once.
            self.torch_path.copy(replace(job, non_blocking=False))
            return
        device = job.src_device
        src_bases = np.array([s.tensor.data_ptr() for s, _ in job.pairs], dtype=np.int64)
        dst_bases = np.array([d.tensor.data_ptr() for _, d in job.pairs], dtype=np.int64)
        alignment = int(np.bitwise_or.reduce(np.concatenate([src_bases, dst_bases])))
        blocks = int(job.src_ids.size)
        launch = plan_copy_launch(
            job.plan, pairs=len(job.pairs), blocks=blocks, alignment=alignment, limits=self.limits_for(device)
        )
        src_indexed = not _is_arange(job.src_ids)
        dst_indexed = not _is_arange(job.dst_ids)
        arrays = [src_bases, dst_bases]
        arrays += [job.src_ids] if src_indexed else []
        arrays += [job.dst_ids] if dst_indexed else []
        try:
            tables = self._upload(arrays, device, keep)
        except OUT_OF_MEMORY as err:
            raise BackendError(f"{device}: out of memory for a copy's tables: {first_line(err)}") from None
        call = kernels.copy_call(
            launch,
            src_bases=tables[0],
            dst_bases=tables[1],
            src_ids=tables[2] if src_indexed else None,
            dst_ids=tables[-1] if dst_indexed else None,
            blocks=blocks,
            src_block_stride=job.plan.src_block_stride,
            dst_block_stride=job.plan.dst_block_stride,
        )
        # A kernel that cannot compile or load here is a KVHostError, not Triton's own; a copy
        # of several jobs may have issued the earlier ones, which a retry copies again, alike.
        self._compile([call], device, "copy")
        self.launch(call)

    def copy_host(self, job: CopyJob, *, to_device: bool, keep: list[Any]) -> Callable[[], None] | None:
        """Between host memory and this device; returns host work to run once the device is done.

        Three ways, cheapest first. *Direct*: runs of ids with the same block bytes on both
        sides, one ``copy_`` each. *Host spans*: the device side is gathered (or scattered)
        by one launch into a device staging buffer laid out like the host tensors, which
        crosses the bus as one ``copy_`` per run of host ids (the usual offload: scattered
        device blocks, consecutive host slots). *Bounce*: anything else, or pageable host
        memory with ``non_blocking``: the device staging buffer crosses as one copy to or
        from a pinned bounce buffer, and the CPU backend moves the host side.
        """
        sides = _HostSides.of(job, to_device)
        host = sides.host
        pinned = all(self.runtime.is_pinned(m.tensor) for m in host)
        can_transfer = pinned or not job.non_blocking  # pageable memory: copy_ waits, so only when blocking
        if can_transfer and self.few_spans(job.bytes_moved, self.direct_copies(job)):
            self.copy_direct(job)
            return None
        spans = host_spans(host[0].layout, sides.host_ids)
        transfers = len(host) * host[0].layout.outer_count * (len(spans) if spans is not None else 1 << 40)
        if can_transfer and self.few_spans(job.bytes_moved, transfers):
            self._copy_host_spans(sides, keep)
            return None
        return self._copy_bounced(sides, keep)

    def few_spans(self, nbytes: int, copies: int) -> bool:
        """Whether ``copies`` separate ``copy_`` calls are cheap for ``nbytes``: few, or each large."""
        return copies <= self.max_host_copies or nbytes >= copies * self.direct_span_bytes

    def _copy_host_spans(self, sides: _HostSides, keep: list[Any]) -> None:
        host, device_side, host_ids, device_ids = sides.host, sides.device_side, sides.host_ids, sides.device_ids
        to_device, device = sides.to_device, sides.device
        count = int(host_ids.size)
        # Staging position of a block: its rank among the host ids, so host runs are staging runs.
        order = np.argsort(host_ids, kind="stable")
        positions = np.empty(count, dtype=np.int64)
        positions[order] = np.arange(count)
        staged, staged_members = self.staging(host, count, device, block_major=False)
        keep.append(staged)
        # (first host id, staging position, count) of each run of the sorted host ids.
        spans = [(first, position, n) for first, position, n in find_runs(host_ids[order], positions[order]).tolist()]
        if not to_device:
            self.copy_on_device(_job(list(zip(device_side, staged_members)), device_ids, positions), keep)
        layout, staged_layout = host[0].layout, staged_members[0].layout
        for member, staged_member in zip(host, staged_members):
            host_bytes, staged_bytes = _byte_view(member.tensor), _byte_view(staged_member.tensor)
            for host_outer, staged_outer in zip(layout.outer_offsets_bytes, staged_layout.outer_offsets_bytes):
                for host_start, position, length in spans:
                    h = int(host_outer) + host_start * layout.block_stride_bytes
                    b = int(staged_outer) + position * staged_layout.block_stride_bytes
                    n = length * layout.region_bytes
                    if to_device:
                        staged_bytes[b : b + n].copy_(host_bytes[h : h + n], non_blocking=True)
                    else:
                        host_bytes[h : h + n].copy_(staged_bytes[b : b + n], non_blocking=True)
        if to_device:
            self.copy_on_device(_job(list(zip(staged_members, device_side)), positions, device_ids), keep)

    def _copy_bounced(self, sides: _HostSides, keep: list[Any]) -> Callable[[], None] | None:
        host, device_side, device = sides.host, sides.device_side, sides.device
        count = int(sides.host_ids.size)
        positions = np.arange(count, dtype=np.int64)
        bounce, bounce_members = self.staging(host, count, None)
        staged, staged_members = self.staging(host, count, device)
        keep += [bounce, staged]
        cpu = self.host
        if sides.to_device:
            # The CPU reads the host blocks now, not in stream order: first let this stream
            # (waiting for the caller's) pass what was queued before the call, such as a
            # non-blocking save into these very blocks, as the other ways read them.
            self.runtime.record(self.runtime.current_stream(device)).synchronize()
            cpu.copy(_job(list(zip(host, bounce_members)), sides.host_ids, positions)).wait()
            staged[:count].copy_(bounce[:count], non_blocking=True)
            self.copy_on_device(_job(list(zip(staged_members, device_side)), positions, sides.device_ids), keep)
            return None
        self.copy_on_device(_job(list(zip(device_side, staged_members)), sides.device_ids, positions), keep)
        bounce[:count].copy_(staged[:count], non_blocking=True)
        into_host = _job(list(zip(bounce_members, host)), positions, sides.host_ids)
        return lambda: cpu.copy(into_host).wait()

    def staging(
        self, like: list[Member], count: int, device: torch.device | None, *, block_major: bool = True
    ) -> tuple[torch.Tensor, list[Member]]:
        """A compact buffer for ``count`` blocks of every tensor in ``like``, in its letters.

        ``block_major``: ``[blocks, tensors, block]``, so the first ``count`` blocks of every
        tensor are one span (one copy crosses the bus); else ``[tensors, like's memory
        order]``, so each tensor's outer index holds its blocks back to back as the host
        does. Pinned host memory when ``device`` is None. Rounded up to a power of two of
        blocks, so layouts (and plans, and compiled kernels) repeat across calls.
        """
        layout = like[0].layout
        blocks = next_power_of_two(count)
        dtype = like[0].tensor.dtype
        if block_major:
            letters = "B" + layout.physical.replace("B", "")
            shape = [blocks, len(like)] + [layout.size(a) for a in letters[1:]]
        else:
            letters = layout.physical
            shape = [len(like)] + [blocks if a == "B" else layout.size(a) for a in letters]
        if device is None:
            buffer = self.runtime.host_buffer(shape, dtype)
        else:
            buffer = torch.empty(shape, dtype=dtype, device=device)
        order = [letters.index(a) for a in layout.axes]
        members = []
        for i, member in enumerate(like):
            view = (buffer[:, i] if block_major else buffer[i]).permute(order)
            members.append(Member(member.layer, member.index, view, Layout.of(view, layout.axes, name="staging")))
        return buffer, members

    def direct_copies(self, job: CopyJob) -> int:
        """How many ``copy_`` calls the direct way takes; a large number when it cannot be used."""
        if not job.plan.merge_blocks:
            return 1 << 62
        loops = int(np.prod(job.plan.loops.shape, dtype=np.int64))
        return len(job.pairs) * loops * int(job.runs.shape[0])

    def copy_direct(self, job: CopyJob) -> None:
        """One ``copy_`` per contiguous span: per tensor pair, outer index and run of ids."""
        plan = job.plan
        loops = plan.loops
        offsets = [
            (sum(i * s for i, s in zip(index, loops.src_strides)), sum(i * d for i, d in zip(index, loops.dst_strides)))
            for index in itertools.product(*(range(n) for n in loops.shape))
        ]
        for src, dst in job.pairs:
            src_bytes, dst_bytes = _byte_view(src.tensor), _byte_view(dst.tensor)
            for src_offset, dst_offset in offsets:
                for s0, d0, count in job.runs.tolist():
                    a = src_offset + s0 * plan.src_block_stride
                    b = dst_offset + d0 * plan.dst_block_stride
                    n = count * loops.run_bytes
                    dst_bytes[b : b + n].copy_(src_bytes[a : a + n], non_blocking=True)

    def _copy_between_devices(self, job: CopyJob) -> Completion:
        """Two devices of this type: torch's peer copies, complete on return."""
        self.torch_path.copy(replace(job, non_blocking=False))  # its completion is ours: nothing to drop
        for device in {job.src_device, job.dst_device}:
            self.runtime.record(self.runtime.current_stream(device)).synchronize()
        return Completion()

    # --- helpers -------------------------------------------------------------------------

    def _upload(self, arrays: list[np.ndarray], device: torch.device, keep: list[Any]) -> list[torch.Tensor]:
        """int64 arrays onto ``device`` in one non-blocking copy from pinned memory.

        Each array starts at a 16-byte boundary: Triton specializes a pointer on that
        alignment, and a table placed after a batch-sized one would otherwise flip with
        the batch's parity (one more compiled kernel).
        """
        starts = np.cumsum([0] + [a.size + a.size % 2 for a in arrays])
        host = self.runtime.host_buffer([int(starts[-1])], torch.int64)  # never empty: a job has a pair
        for array, start in zip(arrays, starts):
            host.numpy()[start : start + array.size] = array
        table = host.to(device, non_blocking=True)
        keep += [host, table]
        return [table[start : start + array.size] for array, start in zip(arrays, starts)]


def launcher_build_missing() -> str | None:
    """What Triton lacks here to build its launcher (a C module it compiles at the first
    launch), or None: without it every receive would fail at its first launch, where the
    torch path runs."""
    if not (os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang")):  # as Triton looks
        return "no C compiler (gcc, clang, or CC) for Triton to build its launcher with"
    headers = sysconfig.get_paths()["include"]
    if not os.path.exists(os.path.join(headers, "Python.h")):
        return f"no Python.h in {headers} (the Python development headers) for Triton's launcher"
    return None


class _HostSides(NamedTuple):
    """A copy between host memory and a device, told by side instead of by direction."""

    host: list[Member]
    device_side: list[Member]
    host_ids: np.ndarray
    device_ids: np.ndarray
    device: torch.device
    to_device: bool

    @classmethod
    def of(cls, job: CopyJob, to_device: bool) -> _HostSides:
        sources, dests = [s for s, _ in job.pairs], [d for _, d in job.pairs]
        if to_device:
            return cls(sources, dests, job.src_ids, job.dst_ids, job.dst_device, True)
        return cls(dests, sources, job.dst_ids, job.src_ids, job.src_device, False)


# A device allocator's refusal (torch.OutOfMemoryError from torch 2.5, its CUDA name before).
OUT_OF_MEMORY: type[Exception] = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


class _PreparedReceive(NamedTuple):
    """A receive job's launches, and the device tables and scratch they read (held with the job)."""

    calls: list[Any]  # kernels.KernelCall
    keep: list[torch.Tensor]


def _job(pairs: list[tuple[Member, Member]], src_ids: np.ndarray, dst_ids: np.ndarray) -> CopyJob:
    """A copy between tensors of one layout pair, for the steps of a staged copy."""
    group = CopyGroup(plan_copy(pairs[0][0].layout, pairs[0][1].layout), pairs)
    src, dst = pairs[0][0].tensor.device, pairs[0][1].tensor.device
    return CopyJob(group, src_ids, dst_ids, non_blocking=False, src_device=src, dst_device=dst)


def host_spans(layout: Layout, ids: np.ndarray) -> list[tuple[int, int]] | None:
    """Runs (first id, count) of the sorted ``ids``; None when a block is not one span per outer index."""
    if layout.block_stride_bytes != layout.region_bytes:
        return None
    return [(first, count) for first, _, count in find_runs(np.sort(ids)).tolist()]


def _is_arange(ids: np.ndarray) -> bool:
    return bool(ids.size and ids[0] == 0 and (np.diff(ids) == 1).all())


def _byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view from ``tensor``'s first byte to its last (same memory, no copy)."""
    flat = torch.empty(0, dtype=torch.uint8, device=tensor.device)
    offset = tensor.storage_offset() * tensor.element_size()
    return flat.set_(tensor.untyped_storage(), offset, (byte_extent(tensor),), (1,))
