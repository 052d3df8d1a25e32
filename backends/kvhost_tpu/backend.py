"""The TPU backend: torch_xla tensors (device type ``xla``), one compiled graph per job.

XLA tensors have no strides: their memory order is their shape order (``Layout.of``
reads them that way), so every cache here is ``[*outer, B, *region]`` in shape order and
the work is indexed ops on the cache tensor itself, never on a view of it:

- receive: gather the units' regions, permute them into the local order and write them
  back, for every member, then one sync, so the job is one graph (a call is one job per
  transform group: one graph unless requests name several sender layouts);
- copy: host <-> XLA (bytes reach an XLA device only through host staging) and XLA <->
  XLA: the source blocks are gathered where they lie, permuted into the destination's
  shape order, moved, and written into the destination.

Index lists are padded to a few bucket sizes (``buckets``) so that the graphs compiled
grow with the log of the batch size. Padding repeats the last real entry, so it can
only rewrite a block the request owns, with the bytes the request put there.

Writes are one ``index_put_`` whose indices cover the outer dims and ``B``, the leading
dims: XLA scatters them where they lie (a scatter along an inner dim makes XLA:CPU
transpose the whole cache, twice). The sync is a step barrier, where torch_xla donates
the cache's buffer to the graph, so a call costs O(blocks moved), not O(cache size).
Element types a device would upcast (bf16 and fp8 on XLA:CPU, which converts the whole
operand and rewrites NaN payloads) are written through an integer bitcast instead:
byte-exact, but on XLA:CPU that bitcast is a pass over the whole cache, so there those
writes cost O(cache) (see ``xla.native_writes``; reads stay O(n)).

Copies block until the bytes are in place (``non_blocking`` too: done on return).
torch_xla is imported on first use, never with this module.
"""

from __future__ import annotations

import threading
from typing import ClassVar

import numpy as np
import torch

from kvhost.backend import Backend, Completion, next_power_of_two
from kvhost.batch import CopyJob, ReceiveJob, ZeroJob
from kvhost.caches import Member
from kvhost.errors import LayoutError
from kvhost.layout import Layout, view_as_letters
from kvhost.transform import Rearrangement
from kvhost_tpu import xla
from kvhost_tpu.buckets import MIN_BUCKET, bucket_size, pad_rows

# torch_xla's lazy tensors are not safe to update from two threads at once (a sync in one
# thread can catch the other's half-built graph), nor to read while another thread updates
# them (data_ptr then fails); the device runs one graph at a time anyway. Reentrant: the
# front end holds it around a whole call (``exclusive``), the backend's calls take it again.
_GRAPH_LOCK = threading.RLock()


class TpuBackend(Backend):
    name = "tpu"
    # zero, raw and write_raw see XLA tensors only: kvhost asks a backend about the
    # devices it serves (get_backend refuses any other), host tensors go to their own.
    device_types = ("xla",)
    priority = 10
    # Smallest padded index length; larger batches pad to the next power of two.
    min_bucket: ClassVar[int] = MIN_BUCKET

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return xla.missing()

    def describe(self) -> str:
        return f"torch_xla, one graph per call, indices padded to powers of two from {self.min_bucket}"

    def exclusive(self) -> threading.RLock:
        return _GRAPH_LOCK

    def check_receive(self, job: ReceiveJob) -> None:
        _check_members(job.members, written=True)

    def check_copy(self, job: CopyJob) -> None:
        _check_members([src for src, _ in job.pairs], written=False)
        _check_members([dst for _, dst in job.pairs], written=True)

    def receive(self, job: ReceiveJob) -> None:
        with _GRAPH_LOCK:
            self._receive(job)

    def zero(self, job: ZeroJob) -> None:
        """One graph per bucket, whatever the cut points: each block and the first token it
        loses are graph data, padded like every other index list (an ``index_fill_`` per
        cut token would compile a graph for nearly every prompt length). Whole blocks cut
        at token 0; padding repeats the last (block, cut), so it writes the same bytes twice."""
        _check_members(job.members, written=True)
        with _GRAPH_LOCK:
            cuts = np.stack(
                [
                    np.concatenate([job.whole_ids, job.partial_ids]),
                    np.concatenate([np.zeros_like(job.whole_ids), job.partial_from]),
                ],
                axis=1,
            )
            cuts = pad_rows(cuts, bucket_size(cuts.shape[0], self.min_bucket))
            ids, first_zeroed = _upload(cuts[:, 0], job.device), _upload(cuts[:, 1], job.device)
            written = [_writable(member.tensor) for member in job.members]
            for cache in written:
                _zero_tails(cache, job.layout, ids, first_zeroed)
            xla.sync_tensors(written)

    def raw(self, tensor: torch.Tensor) -> torch.Tensor:
        """XLA tensors have no byte views: the bytes are a copy, bitcast on the device
        (``view(dtype)`` would move fp16 through f32 and rewrite NaN payloads)."""
        xla.check_dtype(tensor.dtype, "an XLA tensor")
        return xla.bitcast(tensor, xla.raw_dtype(tensor.dtype))

    def write_raw(self, tensor: torch.Tensor, values: torch.Tensor) -> None:
        tensor.copy_(values.contiguous().view(tensor.dtype).to(tensor.device))

    def copy(self, job: CopyJob) -> Completion:
        with _GRAPH_LOCK:  # checked (check_copy) with the call's other jobs, before any ran
            return self._copy(job)

    def _receive(self, job: ReceiveJob) -> None:
        units = job.unit_ids
        # The floor counted in blocks: a unit of g blocks (a sender's block g times ours) is
        # g of them, so one small request from such a sender gathers no 16 x g blocks.
        floor = next_power_of_two(-(-self.min_bucket // units.shape[1]))
        padded = pad_rows(units, bucket_size(units.shape[0], floor)).reshape(-1)
        ids = _upload(padded, job.device)
        written = [_writable(member.tensor) for member in job.members]
        for member, cache in zip(job.members, written):
            _rearrange(cache, block_dim(member.layout), job.rearrangement, ids)
        xla.sync_tensors(written)  # this job's graph alone: an engine's pending work is left as it was

    def _copy(self, job: CopyJob) -> Completion:
        count = job.src_ids.size
        size = bucket_size(count, self.min_bucket)
        src_ids, dst_ids = pad_rows(job.src_ids, size), pad_rows(job.dst_ids, size)
        to_host: list[tuple[Member, torch.Tensor]] = []
        written: list[torch.Tensor] = []
        dst_index: torch.Tensor | None = None  # uploaded once: every destination is on one device
        for src, dst in job.pairs:
            # Gather first, permute after: a permute of the whole cache would copy it.
            picked = view_as_letters(_gather(src, src_ids), src.layout.axes, dst.layout.axes)
            if dst.tensor.device.type == "xla":
                # The padded rows repeat the last real pair, byte for byte.
                dst_index = _upload(dst_ids, dst.tensor.device) if dst_index is None else dst_index
                cache = _writable(dst.tensor)
                _write_rows(cache, block_dim(dst.layout), dst_index, _moved_to(picked, cache))
                written.append(cache)
            else:
                to_host.append((dst, _as_integers(picked)))
        # Everything above is one graph (gathers, permutes, writes), and nothing else pending.
        xla.sync_tensors([*written, *(picked for _, picked in to_host)])
        for dst, picked in to_host:
            b = dst.layout.axes.index("B")
            rows = picked.cpu().numpy()[(slice(None),) * b + (slice(0, count),)]  # the real rows
            dest = dst.tensor.view(xla.raw_dtype(dst.tensor.dtype)).numpy()
            dest[(slice(None),) * b + (job.dst_ids,)] = rows
        return Completion()


def block_dim(layout: Layout) -> int:
    """Where ``B`` is in an XLA tensor's shape, which is also its memory order."""
    if layout.physical != layout.axes:
        before = "".join(a for a in layout.axes[: layout.axes.index("B")] if a in layout.region)
        if before:  # a size-1 N or C named before B (Layout.physical): the one way an XLA tensor gets here
            raise LayoutError(
                f"XLA tensor with axes {layout.axes!r}: {before} (of size 1) is named before B; an XLA tensor's "
                "memory is its shape order, where the block region must follow B"
            )
        raise LayoutError(f"XLA tensor with axes {layout.axes!r} has physical order {layout.physical!r}")
    return layout.axes.index("B")


def write_dtype(cache: torch.Tensor) -> torch.dtype:
    """The element type ``cache`` is rewritten in: its own where the device writes it as is."""
    return cache.dtype if xla.native_writes(cache.device, cache.dtype) else xla.raw_dtype(cache.dtype)


def _rearrange(cache: torch.Tensor, b: int, plan: Rearrangement, ids: torch.Tensor) -> None:
    """Rewrite the units ``ids`` of ``cache`` (shape ``[*outer, B, *region]``) from wire to local order."""
    work = xla.bitcast(cache, write_dtype(cache))
    outer = list(cache.shape[:b])
    region = list(cache.shape[b + 1 :])
    units = ids.numel() // plan.parts
    wire = work.index_select(b, ids).reshape(*outer, units, *plan.src_shape)
    dims = list(range(b + 1)) + [b + 1 + p for p in plan.perm]
    local = wire.permute(dims).reshape(*outer, units * plan.parts, *region)
    _write_rows(cache, b, ids, local, work)


def _write_rows(
    cache: torch.Tensor, b: int, ids: torch.Tensor, rows: torch.Tensor, work: torch.Tensor | None = None
) -> None:
    """``cache``'s blocks ``ids`` receive ``rows`` (``[*outer, len(ids), *region]``), in place.

    ``rows`` are in ``write_dtype(cache)``; ``work`` is the cache in that type, when the
    caller has it already.
    """
    if work is None:
        work = xla.bitcast(cache, write_dtype(cache))
    # Index every leading dim: XLA then scatters whole regions where they lie.
    grids = [
        torch.arange(size, device=cache.device).reshape([1] * i + [size] + [1] * (b - i))
        for i, size in enumerate(cache.shape[:b])
    ]
    work.index_put_((*grids, ids.reshape([1] * b + [-1])), rows)
    if work is not cache:
        cache.copy_(xla.bitcast(work, cache.dtype))


def _zero_tails(cache: torch.Tensor, layout: Layout, ids: torch.Tensor, first_zeroed: torch.Tensor) -> None:
    """Zero every token from ``first_zeroed[i]`` on in block ``ids[i]`` of ``cache``, in
    the integer view where the device would upcast the dtype (a float op there rewrites
    the NaN payloads of the bytes it keeps)."""
    b = block_dim(layout)
    n = b + 1 + layout.region.index("N")  # the token dim of the gathered blocks
    work = xla.bitcast(cache, write_dtype(cache))
    blocks = work.index_select(b, ids)
    tokens = torch.arange(layout.block_size, device=cache.device)
    zeroed = tokens.reshape(1, -1) >= first_zeroed.reshape(-1, 1)  # [block, token]: b < n, so it reshapes in place
    shape = [1] * blocks.dim()
    shape[b], shape[n] = zeroed.shape
    _write_rows(cache, b, ids, blocks.masked_fill(zeroed.reshape(shape), 0), work)


def _gather(member: Member, ids: np.ndarray) -> torch.Tensor:
    """The blocks ``ids`` of one member in its own shape order, where it lies: integers on the host."""
    tensor = member.tensor
    if tensor.device.type == "xla":
        work = xla.bitcast(tensor, write_dtype(tensor))
        return work.index_select(block_dim(member.layout), _upload(ids, tensor.device))
    # Host indexing on the raw bytes, in numpy: CPU index ops lack some KV dtypes (fp8),
    # and torch's worker threads would contend with the XLA runtime's for the same cores.
    raw = tensor.view(xla.raw_dtype(tensor.dtype)).numpy()
    return torch.from_numpy(np.take(raw, ids, axis=member.layout.axes.index("B")))


def _moved_to(picked: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """``picked`` on ``cache``'s device, in ``write_dtype(cache)``: bytes cross devices as integers.

    Host rows go as they are: making them contiguous in numpy first (to keep torch's
    threads off the XLA runtime's cores) was no faster, measured (0.055-0.064 s against
    0.059-0.073 s for 100 permuted blocks of 4 layers, medians of 6)."""
    return xla.bitcast(_as_integers(picked).to(cache.device), write_dtype(cache))


def _as_integers(picked: torch.Tensor) -> torch.Tensor:
    """Data about to leave its device, as integers (torch_xla moves fp16 through f32)."""
    return xla.bitcast(picked, xla.raw_dtype(picked.dtype))


def _upload(ids: np.ndarray, device: torch.device) -> torch.Tensor:
    """Index tensor on ``device``: device data, a graph parameter, not a constant baked into it."""
    return torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64)).to(device)


def _writable(cache: torch.Tensor) -> torch.Tensor:
    """The cache to write in place: an alias of its buffer outside autograd (``detach``), as
    the other backends write (an in-place op on a cache that requires grad raises)."""
    return cache.detach()


def _check_members(members: list[Member], *, written: bool) -> None:
    """What the device refuses, before any of a job runs: a dtype it has no bits for, a block
    region that does not follow ``B`` in the shape, and (for what is ``written``) a view of
    a larger buffer."""
    for member in members:
        tensor = member.tensor
        if tensor.device.type != "xla":  # a host side is copied by torch, byte for byte
            continue
        xla.check_dtype(tensor.dtype, member.name)
        block_dim(member.layout)
        # A view of all of it writes as itself. The storage's size, not ``_base``: a view
        # made under inference mode (as vLLM runs) has no ``_base`` and writes back alike.
        if written and tensor.untyped_storage().nbytes() != tensor.nbytes:
            # torch_xla writes a view back through its base in the base's element type: the
            # whole buffer is rewritten (NaN payloads of bf16/fp8 changed, blocks not named
            # too) and not in place.
            raise LayoutError(
                f"{member.name}: an XLA view of a larger buffer (a slice, or K taken off a K dim) cannot be "
                "written in place; give the whole tensor (in a copy, K as a dim on both sides, or K and V as "
                "tuples on both)"
            )
