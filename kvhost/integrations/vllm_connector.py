"""A NIXL connector vLLM loads: vLLM 0.33's own, with kvhost doing its worker's block work.

Pass it to vLLM as::

    --kv-transfer-config '{"kv_connector": "KvhostNixlConnector",
        "kv_connector_module_path": "kvhost.integrations.vllm_connector", "kv_role": "kv_both"}'

It is vLLM's ``NixlConnector`` (the pull connector: handshake, scheduler, NIXL reads,
notifications, failures, all vLLM's code), with a worker that routes three jobs through
kvhost, one call per step each, and reads what vLLM cannot:

- the decode-side post-process: every request of every remote engine that finished
  this step is rearranged from its sender's layout and block size in one
  ``VllmCaches.post_process`` call, each sender with its own transform (vLLM turns one
  permute on for the whole worker), partial last blocks zeroed as vLLM zeroes them;
- the host-buffer staging vLLM uses where NIXL cannot reach device memory (TPU, XPU,
  plugin devices): one save per step for every request to save, one load per step for
  every request received, instead of a copy per request;
- the handshake accepts remote KVCacheLayouts vLLM refuses (all pairs but LBHNC ->
  LBNHC; docs/integrations.md lists the ones taken), block sizes that differ with host
  buffers too, and remote blocks larger than ours (g x ours; vLLM refuses them): each
  sender block is read as units
  (``LargerRemoteBlocks``: chunks of ``kvhost.nixl.plan_transfer``, one per block of
  ours, cut once more per run of the sender's tokens), so that the bytes land as
  kvhost's wire model says, whole sender blocks and sender blocks read in part alike;
- hybrid models of full and sliding-window attention: vLLM's groups share memory and one
  pool of blocks, so each memory is described once and a request's blocks of every
  attention group go in the step's one call (``_memories``, ``_kvhost_ids``); Mamba
  state beside them is vLLM's to read and never kvhost's to touch (``_state_groups``).

docs/integrations.md lists every method the worker overrides, and why.

This module imports vLLM; ``import kvhost`` and ``kvhost.integrations.vllm`` never
import it, so it is only loaded when vLLM loads it.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from math import prod
from typing import Any, NamedTuple, cast

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import (
    NixlBaseConnector,
    NixlPullConnector,
    NixlPullConnectorScheduler,
    NixlPullConnectorWorker,
)
from vllm.logger import init_logger
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
)

from kvhost.errors import KVHostError, LayoutError, RequestError
from kvhost.integrations.vllm import RemoteEngine, VllmCaches
from kvhost.nixl import RegionTable, Stream, TransferError, TransferPlan, plan_transfer
from kvhost.nixl.agent import keep_past_exit, peer_gone
from kvhost.nixl.hugepages import HugePages, back_host_tensors_with_huge_pages
from kvhost.nixl.ucx import give_ucx_defaults
from kvhost.stats import ReceiveStats

logger = init_logger(__name__)
NOT_POSTED = "NIXL_ERR_NOT_POSTED"  # what NIXL raises when asked of a read it never posted
# The kinds of KV cache group a hybrid model may bring (each block a page of tokens, the
# window's only clipped): full and sliding-window attention, MHA or MLA.
HYBRID_SPECS = frozenset({FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec, SlidingWindowMLASpec})
# The layouts of a model with Mamba state beside its attention, on either side: layers
# outside blocks, a block one page of attention or of state. vLLM 0.33 registers a Mamba
# region of a layout with layers inside blocks at the page's stride, not the block's, and
# in LHBNC an attention block and a state block of one id lie at different strides.
MAMBA_LAYOUTS = ("LBNHC", "LBHNC")

__all__ = ["KvhostNixlConnector", "KvhostNixlWorker", "LargerRemoteBlocks", "sender_blocks_touched"]


def sender_blocks_touched(start: int, count: int, g: int) -> list[tuple[int, int, int]]:
    """``(j, first, end)`` for every sender block that our blocks ``start .. start + count - 1``
    (positions in the request's token order) touch: our position ``p`` lies in sender block
    ``p // g`` at part ``p % g``, and sender block ``j`` gives parts ``first .. end - 1``."""
    touched = []
    position, stop = start, start + count
    while position < stop:
        j, first = divmod(position, g)
        end = min(stop - j * g, g)
        touched.append((j, first, end))
        position = j * g + end
    return touched


class ReadFrom(NamedTuple):
    """A request's sender as its read was posted (``_note_read``)."""

    engine: RemoteEngine
    larger: LargerRemoteBlocks | None  # how a larger sender's blocks are read
    skipped: int = 0  # the sender's tokens before our first position, not read (a smaller sender after a hit)


@dataclass(frozen=True)
class LargerRemoteBlocks:
    """How a sender whose blocks hold ``g`` of ours is read, and post-processed.

    ``plan`` is ``kvhost.nixl.plan_transfer`` of our regions and the sender's, as vLLM
    registered them (one stream per NIXL region): chunks of our region's size, ``g`` per
    sender block, so that our blocks, in groups of ``g``, hold one sender region each (the
    wire model, docs/design.md). A chunk is cut once more, into ``runs`` units: the
    sender's region holds ``runs`` runs of tokens (one per index of its letters before
    ``N``: a head-major sender's heads), and a unit is one run's ``n`` tokens, ``n`` our
    block size. Units let a request read only part of a sender block (a last group of
    fewer than ``g`` of our blocks, or a first one after a prefix-cache hit that ends
    inside a sender block): it lands as a sender with that part as its block would send
    it. A sender block's unit ``h * g + t`` (run ``h``, tokens ``t * n ..``) is its
    ``h * g + t``-th unit in memory, so whole blocks read as whole chunks do.
    """

    plan: TransferPlan
    runs: int

    @property
    def g(self) -> int:
        return self.plan.remote_parts

    @property
    def units(self) -> int:
        """Units per sender block."""
        return self.runs * self.g

    @property
    def unit_bytes(self) -> int:
        return self.plan.chunk_bytes // self.runs

    def unit_ids(self, sender_blocks: Sequence[int], start: int, count: int) -> list[int] | None:
        """The sender units, in the order they land, that fill our ``count`` blocks from
        position ``start`` on; None when the sender's blocks do not reach that far."""
        ids: list[int] = []
        for j, first, end in sender_blocks_touched(start, count, self.g):
            if j >= len(sender_blocks):
                return None
            base = int(sender_blocks[j]) * self.units
            ids.extend(base + h * self.g + t for h in range(self.runs) for t in range(first, end))
        return ids

    def pieces(self, start: int, count: int) -> list[tuple[int, int, int]]:
        """``(offset, length, parts)``: our blocks ``offset .. offset + length - 1`` (of the
        ``count`` from position ``start``) hold the wire bytes of a sender whose blocks hold
        ``parts`` of ours: whole sender blocks together (``parts == g``), and each sender
        block read in part as a sender of that part."""
        pieces: list[tuple[int, int, int]] = []
        offset = 0
        for _, first, end in sender_blocks_touched(start, count, self.g):
            parts = end - first
            if parts == self.g and pieces and pieces[-1][2] == self.g:
                at, length, _ = pieces[-1]
                pieces[-1] = (at, length + parts, self.g)
            else:
                pieces.append((offset, parts, parts))
            offset += parts
        return pieces


class KvhostNixlWorker(NixlPullConnectorWorker):  # type: ignore[misc]
    """vLLM's pull worker; post-process and host staging are kvhost calls, one per step."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Before vLLM's __init__, which sets use_host_buffer (a property here).
        # .running: this thread is in vLLM's handshake checks; .larger: the larger sender's
        # plan of the handshake this thread makes, until vLLM accepts it.
        self._handshake_checks = threading.local()
        self._use_host_buffer = False
        give_ucx_defaults()  # before vLLM's __init__ starts its NIXL agent (and UCX reads them)
        super().__init__(*args, **kwargs)
        # The transfer groups of Mamba state (vLLM's own kinds of its groups): vLLM reads
        # them as they lie; their ids are logical blocks of another kind, never kvhost's.
        kinds = self._group_spec_types
        self._state_groups = frozenset(i for i, kind in enumerate(kinds) if issubclass(kind, MambaSpec))
        self.kvhost: VllmCaches | None = None  # the device caches, once registered
        self._memories: dict[str, str] = {}  # layer name -> the layer whose memory kvhost describes for it
        # engine -> (its KVCacheLayout, its block size), from its last handshake vLLM accepted.
        self.remote_engines: dict[str, RemoteEngine] = {}
        # engine -> how its blocks are read, for senders whose blocks hold g > 1 of ours.
        self.larger_remote_blocks: dict[str, LargerRemoteBlocks] = {}
        # request -> its sender as the request's read was posted (``_note_read``): an engine
        # that registers again (vLLM shakes hands anew) may bring another layout while reads
        # posted under the old one are still in flight; each is post-processed as it was read.
        self._read_from: dict[str, ReadFrom] = {}
        self.last_post_process: ReceiveStats | None = None
        self.kvhost_huge_pages = HugePages()  # what asking for huge pages under registered host memory did
        self._loads: dict[str, list[int]] = {}
        self._packs: list[list[int]] = []  # vLLM's CPU attention repacks of a step, run after kvhost's
        # The step's receiving requests, while get_transfer_results runs: vLLM pops finished
        # ones (and may drop their engine) before kvhost post-processes them.
        self._receiving: dict[str, Any] = {}
        self._dropped_engines: set[str] = set()  # dropped by vLLM; their notes go once no request needs them

    # --- registration ------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """vLLM's, with caches in host memory first backed by huge pages, which lets a peer
        on the same machine read them near memcpy speed (``kvhost.nixl.hugepages``).

        A hybrid model (full and sliding-window attention) has several transfer groups,
        which vLLM lays over the same memory: the i-th layer of each group is one tensor,
        and a block id, drawn from one pool, is one group's block in every such tensor. So
        kvhost describes each memory once (``_memories``) and a request's blocks are those
        of all its attention groups. Mamba state lies in the same memory, a block of it a
        page as large as an attention block: kvhost describes the attention layers' views
        alone, and vLLM reads the state's blocks as they lie. Groups whose pages differ, or
        of other kinds (chunked local attention), are refused first, naming them."""
        self._check_transfer_groups()
        attention = {name for group in self._attention_groups() for name in group.layer_names}
        self._memories = _memories({name: view for name, view in kv_caches.items() if name in attention})
        described = {name: kv_caches[name] for name in dict.fromkeys(self._memories.values())}
        self.kvhost = VllmCaches(described, self.kv_cache_layout, group=_registered_as_rows(described))
        self.kvhost_huge_pages = back_host_tensors_with_huge_pages(m.tensor for m in self.kvhost.caches.members)
        super().register_kv_caches(kv_caches)  # in host-buffer mode, calls initialize_host_xfer_buffer

    def _check_transfer_groups(self) -> None:
        """Several transfer groups are taken where each is full or sliding-window attention,
        all of one page (block size, heads, head size, dtype and padding); Mamba state beside
        such attention too, in a layout of ``MAMBA_LAYOUTS``, read from device memory (no host
        buffers) and beside no MLA."""
        groups = self.kv_cache_config.transfer_groups
        if len(groups) == 1 and not self._state_groups:
            return
        named = "; ".join(
            f"group {i}: {type(group.kv_cache_spec).__name__} of {len(group.layer_names)} layers "
            f"({', '.join(map(repr, group.layer_names[:2]))}{', ...' if len(group.layer_names) > 2 else ''})"
            for i, group in enumerate(groups)
        )
        specs = [group.kv_cache_spec for group in self._attention_groups()]
        if not specs or any(type(spec) not in HYBRID_SPECS for spec in specs):
            raise LayoutError(
                f"KvhostNixlConnector takes several KV cache groups only of full and sliding-window attention "
                f"({', '.join(sorted(kind.__name__ for kind in HYBRID_SPECS))}), with or without Mamba state "
                f"beside them, got {len(groups)}: {named or 'none'}"
            )
        pages = {
            (spec.block_size, spec.num_kv_heads, spec.head_size, spec.dtype, spec.page_size_padded) for spec in specs
        }
        if len(pages) != 1:
            raise LayoutError(
                "KvhostNixlConnector takes several KV cache groups only where their pages are alike (block size, "
                f"KV heads, head size, dtype, padding), got {sorted(map(str, pages))}: {named}"
            )
        if not self._state_groups:
            return
        layout = self.kv_cache_layout
        for refused, what in (
            (layout not in MAMBA_LAYOUTS, f"a {layout} KV cache (one of {', '.join(MAMBA_LAYOUTS)} is taken)"),
            (self.use_host_buffer, "host buffers (vLLM 0.33 registers host regions larger than its state buffers)"),
            (self.use_mla, "MLA attention (vLLM splits its blocks in reads of their own, not tried here)"),
        ):
            if refused:
                raise LayoutError(f"KvhostNixlConnector takes a model with Mamba state, but not with {what}: {named}")

    def _attention_groups(self) -> list[Any]:
        """vLLM's transfer groups kvhost describes: all but those of Mamba state."""
        groups = self.kv_cache_config.transfer_groups
        return [group for i, group in enumerate(groups) if i not in self._state_groups]

    def unregister_kv_caches(self) -> None:
        """vLLM's (sleep mode), refused while a read may still write into the caches."""
        in_flight = self.reads_in_flight()
        if in_flight:
            raise TransferError(
                f"{in_flight} NIXL read(s) still in flight may write into the KV caches: they stay registered"
            )
        super().unregister_kv_caches()

    def shutdown(self) -> None:
        """vLLM's, unless a read may still write. NIXL's release of a read in flight does
        not stop it (``kvhost.nixl.Transfer.release``), and vLLM's shutdown releases every
        read, deregisters the caches and drops the host buffers: the read would land in freed
        memory. Then nothing is released and this worker (its NIXL agent, buffers, caches'
        registrations) is kept until the process exits; a later shutdown that finds every
        read over goes on as vLLM's."""
        in_flight = self.reads_in_flight() if hasattr(self, "_recving_transfers") else 0
        if not in_flight:
            super().shutdown()
            return
        keep_past_exit(self)
        logger.warning(
            "%d NIXL read(s) still in flight at shutdown: their memory and the NIXL agent are kept "
            "until this process exits",
            in_flight,
        )

    def reads_in_flight(self) -> int:
        """The reads vLLM has posted and not released that NIXL does not say are over
        (landed, or their peer gone; one NIXL cannot say of counts as in flight)."""
        count = 0
        for handles in list(self._recving_transfers.values()):
            for handle in handles:
                try:
                    over = self.nixl_wrapper.check_xfer_state(handle) != "PROC"
                except Exception as err:  # NIXL raises its failures; these two say nothing moves
                    over = peer_gone(err) or NOT_POSTED in str(err)
                count += not over
        return count

    def initialize_host_xfer_buffer(self, kv_caches: dict[str, Any]) -> None:
        """Host buffers in the device caches' memory order (layer views of one buffer where
        the device's are), so a save or a load is a plain block copy, and what the
        handshake says of our layout is true of the host buffer too."""
        assert self.kvhost is not None  # made from these very caches by register_kv_caches, just before
        buffers = self.kvhost.host_buffers()  # one per memory; vLLM's are by layer name, its groups' too
        self.host_xfer_buffers = {name: buffers[self._memories[name]] for name in kv_caches}
        self.host_buffer_kv_cache_layout = self.kv_cache_layout
        views = cast("dict[str, torch.Tensor]", buffers)  # vLLM's layers are tensors, so are their host buffers
        self.kvhost_huge_pages += back_host_tensors_with_huge_pages(views.values())

    def _host_buffers(self) -> dict[str, Any]:
        """vLLM's host buffers as kvhost describes them: each memory once."""
        return {name: self.host_xfer_buffers[name] for name in self._memories.values()}

    # --- handshake ---------------------------------------------------------------------

    def add_remote_agent(
        self, nixl_agent_meta: Any, remote_tp_rank: int = 0, remote_tp_size: int = 1, remote_dcp_size: int = 1
    ) -> str:
        """vLLM's, after noting the engine's layout and block size; a sender whose blocks
        hold g > 1 of ours is shown to vLLM as blocks of units (``LargerRemoteBlocks``)."""
        engine = nixl_agent_meta.engine_id
        if (0, remote_tp_rank) in self._remote_agents.get(engine, {}):
            return str(super().add_remote_agent(nixl_agent_meta, remote_tp_rank, remote_tp_size, remote_dcp_size))
        larger = None  # refused here, before anything is noted
        theirs = (nixl_agent_meta.block_size, nixl_agent_meta.physical_blocks_per_logical_kv_block)
        if self._is_hma_required and theirs != (self.block_size, self._physical_blocks_per_logical_kv_block):
            # vLLM sends each side's last blocks of a window, counted in each side's blocks
            # (logical ones, each of kernel blocks): lists that start at other tokens where
            # either size differs.
            raise LayoutError(
                f"engine {engine!r}: blocks of {theirs[0]} tokens, {theirs[1]} a logical block; ours "
                f"{self.block_size}, {self._physical_blocks_per_logical_kv_block}: a cache vLLM clips to a window "
                "(a group that is not full attention) takes only senders of our block sizes"
            )
        if self._state_groups and nixl_agent_meta.kv_cache_layout not in MAMBA_LAYOUTS:
            raise LayoutError(
                f"engine {engine!r}: a {nixl_agent_meta.kv_cache_layout} KV cache; with Mamba state beside the "
                f"attention only {' and '.join(MAMBA_LAYOUTS)} senders are taken (vLLM 0.33 registers others' "
                "Mamba regions at the page's stride, not the block's)"
            )
        if nixl_agent_meta.block_size > self.block_size:
            larger = self._plan_larger_remote_blocks(nixl_agent_meta, remote_tp_size, remote_dcp_size)
        self._check_post_process(nixl_agent_meta)
        remote = RemoteEngine(nixl_agent_meta.kv_cache_layout, nixl_agent_meta.block_size)
        if larger is not None:
            nixl_agent_meta = _in_units(nixl_agent_meta, larger, self.block_size)
        # Noted once vLLM accepts it: a step on another thread never meets a layout that
        # vLLM may yet refuse. Only this thread's _build_fa_remote reads the plan meanwhile.
        self._handshake_checks.larger = larger
        try:
            name = str(super().add_remote_agent(nixl_agent_meta, remote_tp_rank, remote_tp_size, remote_dcp_size))
        finally:
            self._handshake_checks.larger = None
        self.remote_engines[engine] = remote
        _note(self.larger_remote_blocks, engine, larger)
        return name

    @property
    def use_host_buffer(self) -> bool:
        """vLLM's flag; False only on a thread running vLLM's handshake checks here, so that a
        step on another thread (vLLM shakes hands on its own thread) sees the worker's mode."""
        if getattr(self._handshake_checks, "running", False):
            return False
        return self._use_host_buffer

    @use_host_buffer.setter
    def use_host_buffer(self, value: bool) -> None:
        self._use_host_buffer = value

    def _validate_remote_agent_handshake(self, nixl_agent_meta: Any, remote_tp_size: int, *args: Any) -> None:
        """vLLM's checks, less two refusals kvhost makes moot: another remote KVCacheLayout
        (each sender gets its own transform) and block sizes that differ in host-buffer mode
        (the host buffer is laid out like the device). vLLM is shown our layout as the
        sender's, so it never turns on its worker-wide permute either. Hiding the sender's
        layout also hides it from vLLM's heterogeneous-TP refusal, which kvhost makes instead
        (``_check_head_split``)."""
        self._check_head_split(nixl_agent_meta, remote_tp_size)
        self._check_region_rearranges(nixl_agent_meta)
        theirs = nixl_agent_meta.kv_cache_layout
        nixl_agent_meta.kv_cache_layout = self.kv_cache_layout  # the host buffer's too (initialize_host_xfer_buffer)
        self._handshake_checks.running = True
        try:
            super()._validate_remote_agent_handshake(nixl_agent_meta, remote_tp_size, *args)
        finally:
            nixl_agent_meta.kv_cache_layout = theirs
            self._handshake_checks.running = False

    def _check_post_process(self, meta: Any) -> None:
        """Refuse a sender whose bytes kvhost could not post-process (a layout name it does
        not know, letters or a block size no plan serves): vLLM is shown our layout, so its
        own refusal never sees the sender's, and a sender taken here would fail, at each step,
        every request finished beside one of its own."""
        assert self.kvhost is not None
        try:
            order = self.kvhost.remote_order(meta.kv_cache_layout)
            self.kvhost.caches.receive_groups(order, meta.block_size)
        except KVHostError as err:
            raise LayoutError(
                f"engine {meta.engine_id!r}: its {meta.kv_cache_layout!r} blocks of {meta.block_size!r} tokens "
                f"cannot be post-processed here: {err}"
            ) from None

    def _check_head_split(self, meta: Any, remote_tp_size: int) -> None:
        """Refuse a sender of another tensor-parallel size whose block regions hold their
        letters in another order than ours. vLLM then reads a share of heads per rank and
        places it as if both sides had one layout; the post-process, which sees one block,
        cannot undo that. (MLA and replicated KV split no heads: any order stays right.)"""
        assert self.kvhost is not None and self.transfer_topo is not None
        engine = meta.engine_id
        if (
            abs(self.transfer_topo.tp_ratio(remote_tp_size)) == 1
            or self.use_mla
            or self.transfer_topo.is_kv_replicated(engine)
        ):
            return
        theirs = self.kvhost.remote_order(meta.kv_cache_layout)
        ours = self.kvhost.remote_order(self.kv_cache_layout)
        if theirs != ours:
            raise LayoutError(
                f"engine {engine!r}: tensor-parallel size {remote_tp_size} (ours {self.transfer_topo.tp_size}) "
                f"splits heads, which needs the sender's blocks in our region order; its {meta.kv_cache_layout} "
                f"blocks read {theirs!r} there, our {self.kv_cache_layout} blocks {ours!r}"
            )

    def _check_region_rearranges(self, meta: Any) -> None:
        """Refuse a sender whose bytes need rearranging where our NIXL regions are not
        kvhost's block regions (vLLM registered rows of every layer where kvhost describes
        each layer's part, or the other way round: ``_registered_as_rows`` guessed wrong):
        the post-process would rearrange each part as if the sender's bytes for it had
        landed there. A sender of our layout and block size needs no rearranging, and
        lands right."""
        assert self.kvhost is not None
        if meta.kv_cache_layout == self.kv_cache_layout and meta.block_size == self.block_size:
            return
        layout = self.kvhost.caches.layout
        region_bytes = prod(layout.size(a) for a in layout.region) * layout.itemsize
        registered = sorted(set(self.block_len_per_layer))
        if registered != [region_bytes]:
            raise LayoutError(
                f"engine {meta.engine_id!r}: its {meta.kv_cache_layout} blocks of {meta.block_size} tokens need "
                f"rearranging, but our {self.kv_cache_layout} NIXL regions ({registered} bytes a block) are not "
                f"kvhost's block regions ({layout.region!r}, {region_bytes} bytes); only a sender of our layout "
                f"and block size ({self.block_size}) is taken"
            )

    def _refuse_what_larger_remote_blocks_miss(self, meta: Any, remote_tp_size: int, remote_dcp_size: int) -> None:
        """Refuse, naming it, a sender of blocks g x ours that kvhost's plan does not cover."""
        assert self.transfer_topo is not None
        engine = meta.engine_id
        if meta.block_size % self.block_size:
            raise LayoutError(
                f"engine {engine!r}: remote blocks of {meta.block_size} tokens are not a whole number of ours "
                f"({self.block_size})"
            )
        unsupported = {
            "a different tensor-parallel size": remote_tp_size != self.transfer_topo.tp_size,
            "decode context parallelism": self.dcp_size > 1 or remote_dcp_size > 1,
            "mamba state": self._has_mamba,
            "layer-name routing (pipeline parallelism)": bool(self._transfer_layer_region_indices),
        }  # a cache vLLM clips to a window takes no other block size at all (add_remote_agent)
        for what, present in unsupported.items():
            if present:
                raise LayoutError(
                    f"engine {engine!r}: remote blocks larger than ours ({meta.block_size} > {self.block_size} "
                    f"tokens) with {what} are not supported"
                )

    def _plan_larger_remote_blocks(self, meta: Any, remote_tp_size: int, remote_dcp_size: int) -> LargerRemoteBlocks:
        """kvhost's transfer plan between our NIXL regions and a sender's whose blocks are
        g x ours (vLLM's regions, kvhost's letters: ours from our caches, the sender's from
        its layout name); refuses what it does not cover, naming it."""
        assert self.kvhost is not None
        engine = meta.engine_id
        self._refuse_what_larger_remote_blocks_miss(meta, remote_tp_size, remote_dcp_size)
        layout = self.kvhost.caches.layout
        ours = self.kvhost.caches.layout.region
        sizes = {a: n for a, n in layout.logical_sizes().items() if a in ours}
        order = self.kvhost.remote_order(meta.kv_cache_layout)
        local = _Registered(
            ours,
            self.block_size,
            self.block_len_per_layer,
            self.region_num_blocks,
            self.region_mem_types,
            self.kv_caches_base_addr[self.engine_id][self.tp_rank],
            self.block_stride_per_layer,
            self.device_id,
        )
        remote = _Registered(
            order,
            meta.block_size,
            meta.block_lens,
            meta.region_num_blocks or [meta.num_blocks] * len(meta.block_lens),  # a handshake may leave these out
            meta.region_mem_types or self.region_mem_types,
            meta.kv_caches_base_addr,
            meta.block_strides,
            meta.device_id,
        )
        tables = {
            side: _registered_table(engine, side, regions, ours, sizes, layout.itemsize)
            for side, regions in (("local", local), ("remote", remote))
        }
        plan = plan_transfer(tables["local"], tables["remote"])
        assert plan.local_parts == 1  # the sender's blocks are larger: a chunk is one of our regions
        runs = prod(sizes[a] for a in order[: order.index("N")])
        if self.block_size % runs:
            raise LayoutError(
                f"engine {engine!r}: its {order!r} blocks hold {runs} runs of tokens; reading a part of one "
                f"needs our block size ({self.block_size}) to be a multiple of that"
            )
        return LargerRemoteBlocks(plan, runs)

    def _build_fa_remote(self, plan: Any, nixl_agent_meta: Any, block_size_ratio: int) -> Any:
        """vLLM's remote descriptors, but a larger sender's are its units: per region and
        block, ``units`` descriptors of ``unit_bytes`` in memory order (one strided row per
        region when its blocks are dense, one per block when they are padded)."""
        larger = getattr(self._handshake_checks, "larger", None)  # add_remote_agent's, on this thread
        if larger is None:
            return super()._build_fa_remote(plan, nixl_agent_meta, block_size_ratio)
        remote = larger.plan.remote
        rows = [
            self._block_strided_descs(
                stream.address,
                larger.unit_bytes,
                stream.block_stride,
                remote.num_blocks,
                larger.units,
                remote.device_id,
            )
            for stream in (remote.streams[i] for i in larger.plan.remote_streams)
        ]
        return np.concatenate(rows)

    def _cleanup_remote_engine(self, engine_id: str, *, log_eviction: bool = True) -> None:
        """vLLM's, and kvhost's notes of the engine go too, once no request needs them: vLLM
        may drop an engine in the very step that finishes its last request, before kvhost
        post-processes it; without this, every engine ever met (each prefill restart is a
        new one) would stay noted."""
        super()._cleanup_remote_engine(engine_id, log_eviction=log_eviction)
        self._dropped_engines.add(engine_id)
        self._forget_dropped_engines()

    def _forget_dropped_engines(self) -> None:
        """Forget the notes of engines vLLM dropped, unless the engine shook hands again (its
        notes are the new ones); requests read from one keep their own (``_read_from``). One
        shaking hands again is looked at once it is done: its notes may be the old ones."""
        if not self._dropped_engines:
            return
        with self._handshake_lock:  # a handshake thread notes an engine before vLLM records its agents
            for engine in list(self._dropped_engines):
                if engine in self._remote_agents:
                    self._dropped_engines.discard(engine)  # known again: noted anew
                elif engine not in self._handshake_futures:
                    self.remote_engines.pop(engine, None)
                    self.larger_remote_blocks.pop(engine, None)
                    self._dropped_engines.discard(engine)

    # --- reads ---------------------------------------------------------------------------

    def _read_blocks(self, read_spec: Any, dst_engine_id: str, request_id: str, *args: Any, **kwargs: Any) -> bool:
        """vLLM's read, its sender noted for the post-process; the sender's blocks that land in
        our blocks as the wire model says, from the request's first position on. vLLM pairs
        the last ``len(ours)`` of them, or of its split of ours: after a prefix-cache hit, a
        smaller sender's blocks before ours; and a sender of our block size whose logical
        blocks are larger (more kernel blocks each) lists blocks past the prompt, so its
        last ones are every one of ours shifted by a block."""
        if dst_engine_id not in self.remote_engines:  # vLLM reads only after a handshake here
            return self._read_failed(request_id, dst_engine_id, "no handshake with its engine is noted here")
        larger = self._note_read(request_id, dst_engine_id)
        ratio = self.block_size // self.remote_engines[dst_engine_id].block_size
        if ratio >= 1 and any(read_spec.local_block_ids) and self._lists_start_at_token_zero(dst_engine_id, read_spec):
            first = self._first_position(self._recving_metadata.get(request_id)) * ratio
            skipped = first * self.remote_engines[dst_engine_id].block_size
            self._read_from[request_id] = self._read_from[request_id]._replace(skipped=skipped)
            remote = [
                list(ids[first : first + len(local_ids) * ratio])
                for local_ids, ids in zip(read_spec.local_block_ids, read_spec.remote_block_ids, strict=True)
            ]
            read_spec = dataclasses.replace(read_spec, remote_block_ids=remote)
        if larger is not None and any(read_spec.local_block_ids) and not read_spec.block_ids_by_region:
            meta = self._recving_metadata.get(request_id)
            start = self._first_position(meta)
            remote = []
            for local_ids, unit_ids in zip(read_spec.local_block_ids, read_spec.remote_block_ids, strict=True):
                sender_blocks = [unit // larger.units for unit in unit_ids[:: larger.units]]
                ids = larger.unit_ids(sender_blocks, start, len(local_ids))
                if ids is None:
                    return self._read_failed(
                        request_id,
                        dst_engine_id,
                        f"{len(sender_blocks)} remote blocks do not reach our {len(local_ids)} blocks "
                        f"from position {start}",
                    )
                remote.append(ids)
            read_spec = dataclasses.replace(read_spec, remote_block_ids=remote)
        return bool(super()._read_blocks(read_spec, dst_engine_id, request_id, *args, **kwargs))

    def _lists_start_at_token_zero(self, engine: str, read_spec: Any) -> bool:
        """Whether a request's sender block list starts at its token 0, ours after its
        prefix-cache hit: not where vLLM lays the lists out otherwise (by region, with
        decode context parallelism, Mamba state, or a cache clipped to a window)."""
        if read_spec.block_ids_by_region:
            return False
        remote_dcp = self.transfer_topo.get_engine_info(engine).remote_dcp_size if self.transfer_topo else 1
        return not (self.dcp_size > 1 or remote_dcp > 1 or self._has_mamba or self._is_hma_required)

    def _note_read(self, request_id: str, engine: str) -> LargerRemoteBlocks | None:
        """Note the sender a request is read from, as its accepted handshake says; returns
        how a larger sender's blocks are read (None: not larger)."""
        larger = self.larger_remote_blocks.get(engine)
        self._read_from[request_id] = ReadFrom(self.remote_engines[engine], larger)
        return larger

    def _read_failed(self, request_id: str, engine: str, why: str) -> bool:
        """A read that cannot be posted fails its request as vLLM fails one: logged, recorded."""
        self._log_failure(failure_type="transfer_setup_failed", req_id=request_id, msg=why, dst_engine_id=engine)
        self._handle_failed_transfer(request_id, None, self._recv_failures, record_failed_transfer=False)
        return False

    def _first_position(self, meta: Any) -> int:
        """Where a request's blocks start in its token order: after its prefix-cache hit."""
        computed = getattr(meta, "local_num_computed_blocks", ())
        return int(computed[0]) * int(self._physical_blocks_per_logical_kv_block) if computed else 0

    # --- host staging ------------------------------------------------------------------

    def save_kv_to_host(self, metadata: Any) -> None:
        """Every request to save this step, in one copy (shared prefix blocks once)."""
        assert self.kvhost is not None
        batch: dict[str, list[int]] = {}
        for req_id, meta in metadata.reqs_to_save.items():
            meta.local_physical_block_ids = self._logical_to_kernel_block_ids(
                meta.local_block_ids, self._physical_blocks_per_logical_kv_block
            )
            batch[req_id] = self._kvhost_ids(meta.local_physical_block_ids)
        if batch:
            self.kvhost.save_to_host(self._host_buffers(), batch).wait()

    def sync_recved_kv_to_device(self, req_id: str, meta: Any) -> None:
        """Collected here; loaded for every request of the step in one copy."""
        self._loads[req_id] = self._kvhost_ids(meta.local_physical_block_ids)

    # --- post-process --------------------------------------------------------------------

    def post_process_device_kv_on_receive(self, *args: Any, **kwargs: Any) -> None:
        """Replaced by one kvhost call per step (``get_transfer_results``)."""

    def post_process_device_kv_on_receive_heterogeneous_attn(self, block_ids: list[int]) -> None:
        """Collected here; vLLM's repack into CPU attention's format runs on the bytes
        kvhost loaded and post-processed, as vLLM orders it (``get_transfer_results``)."""
        self._packs.append(list(block_ids))

    def get_transfer_results(self) -> Any:
        """vLLM's, then one kvhost load and one post-process for the step's finished
        requests, then vLLM's repacks. Where kvhost's load or post-process fails, the
        requests it was for are reported as failed receives, their blocks invalid, as vLLM
        reports a failed read, and the error is logged: the step's results are never lost."""
        self._receiving = dict(self._recving_metadata)  # vLLM's loop pops what finished
        self._loads, self._packs = {}, []  # filled by vLLM's loop
        self.last_post_process = None
        try:
            results = super().get_transfer_results()
            assert self.kvhost is not None  # registered before any request could arrive
            failed: set[str] = set()
            if self._loads:
                try:
                    self.kvhost.load_from_host(self._host_buffers(), self._loads).wait()
                except Exception as err:  # any error: the requests must still be reported
                    failed = self._fail_receives(set(self._loads), "host_load_failed", err)
            done = set(results.finished_recving) - set(results.failed_recving) - failed
            pending = {r: self._receiving[r] for r in done if r in self._receiving}
            named = set(pending)  # until the batch says which of them kvhost rearranges
            try:
                received, engines, tokens, named = self._post_process_batch(pending)
                if received:
                    self.last_post_process = self.kvhost.post_process(received, engines, tokens=tokens)
            except KVHostError as err:
                # Refused before any byte moved: the requests are tried one by one, so that one
                # kvhost refuses fails alone, as on vLLM's own path.
                failed |= self._post_process_alone(pending, named, err)
            except Exception as err:  # bytes may have moved: none can be tried again
                failed |= self._fail_receives(named, "post_process_failed", err)
            stale = {
                block
                for req_id in failed
                if req_id in self._receiving
                for block in self._kvhost_ids(self._receiving[req_id].local_physical_block_ids)
            }
            for block_ids in self._packs:
                if stale.isdisjoint(block_ids):
                    super().post_process_device_kv_on_receive_heterogeneous_attn(block_ids)
            results.failed_recving.update(failed)  # already in finished_recving, as vLLM lists failures
        finally:
            self._receiving = {}
            self._forget_dropped_engines()
            # Reads of requests vLLM no longer receives (finished, failed, or a full local hit
            # that only notified) are done with.
            self._read_from = {r: read for r, read in self._read_from.items() if r in self._recving_metadata}
        return results

    def _post_process_alone(self, pending: Mapping[str, Any], named: set[str], refusal: KVHostError) -> set[str]:
        """Post-process each of ``named`` on its own, after the batch was refused; returns
        those that failed. A block two of them name fails both untried: the batch refuses
        it, and two calls alone would rearrange it twice."""
        blocks = {req_id: set(self._kvhost_ids(pending[req_id].local_physical_block_ids)) for req_id in named}
        seen: set[int] = set()
        shared: set[int] = set()
        for ids in blocks.values():
            shared |= seen & ids
            seen |= ids
        assert self.kvhost is not None  # the batch was tried
        failed: set[str] = set()
        done: list[ReceiveStats] = []
        for req_id in sorted(named):
            if not shared.isdisjoint(blocks[req_id]):
                failed |= self._fail_receives({req_id}, "post_process_failed", refusal)
                continue
            try:
                received, engines, tokens, _ = self._post_process_batch({req_id: pending[req_id]})
                if received:
                    done.append(self.kvhost.post_process(received, engines, tokens=tokens))
            except Exception as err:
                failed |= self._fail_receives({req_id}, "post_process_failed", err)
        self.last_post_process = _summed(done)
        return failed

    def _fail_receives(self, requests: set[str], failure_type: str, error: Exception) -> set[str]:
        """Log each request as failed, and mark its blocks invalid as vLLM does for a failed
        read (the scheduler recomputes them)."""
        for req_id in sorted(requests):
            meta = self._receiving.get(req_id)
            self._log_failure(failure_type=failure_type, req_id=req_id, msg=str(error), error=error, meta=meta)
            if meta is not None and not self._is_hma_required:
                self._invalid_block_ids.put(set(meta.local_block_ids[0]))
        return requests

    def _kvhost_ids(self, block_ids: Sequence[Sequence[int]]) -> list[int]:
        """A request's block ids of every attention group, in group order: kvhost's to move and
        rearrange. A hybrid model's groups draw their blocks from one pool, and a block of
        ours holds one sender block whatever its group (``add_remote_agent`` takes no other
        block size), so one list serves them all. A Mamba group's ids are left out: vLLM
        reads its state as it lies, and its ids count logical blocks, not kernel blocks."""
        return [block for i, group in enumerate(block_ids) if i not in self._state_groups for block in group]

    def _post_process_batch(
        self, finished: Mapping[str, Any]
    ) -> tuple[dict[str, dict[str, list[int]]], dict[str, RemoteEngine], dict[str, int], set[str]]:
        """``post_process``'s arguments for the finished requests whose bytes kvhost finishes,
        and those requests' ids. A sender block read in part is a request of its own, from
        a sender of its own, under names no engine or request of the step has (ids are
        anyone's strings: a peer names its engine, a client its request); so is an engine
        read under two registrations (two layouts) by requests finishing in one step."""
        received: dict[str, dict[str, list[int]]] = {}
        engines: dict[str, RemoteEngine] = {}
        tokens: dict[str, int] = {}
        named: set[str] = set()
        taken = set(finished) | {meta.remote.engine_id for meta in finished.values() if meta.remote is not None}
        local_size = self.block_size

        def sender(name: str, remote: RemoteEngine) -> str:
            """``name``, or a name of its own for another layout already under it this step."""
            while engines.setdefault(name, remote) != remote:
                name = _unused(name + "'", taken)
            return name

        for req_id, meta in finished.items():
            if meta.region_blocks_to_zero is not None or meta.remote is None:
                continue  # vLLM zeroed its read plan's padding itself
            engine = meta.remote.engine_id
            local_ids = self._kvhost_ids(meta.local_physical_block_ids)
            if not local_ids:
                continue
            named.add(req_id)
            if req_id not in self._read_from:  # vLLM posts every read through _read_blocks
                raise RequestError(f"request {req_id!r}: received from {engine!r}, but no read of it was posted here")
            remote_engine, larger, skipped = self._read_from[req_id]
            layout, remote_size = remote_engine.kv_cache_layout, remote_engine.block_size
            if larger is not None:
                # Each of our blocks got whole bytes; a sender block read in part reads as a
                # sender whose blocks hold that part: engine/parts, request/offset.
                for offset, length, parts in larger.pieces(self._first_position(meta), len(local_ids)):
                    if parts == larger.g:
                        name, request = engine, req_id
                    else:
                        name, request = _unused(f"{engine}/{parts}", taken), _unused(f"{req_id}/{offset}", taken)
                    name = sender(name, RemoteEngine(layout, parts * local_size))
                    received.setdefault(name, {})[request] = list(local_ids[offset : offset + length])
                continue
            name = sender(engine, remote_engine)
            remote_ids = self._kvhost_ids(meta.remote.block_ids)
            received.setdefault(name, {})[req_id] = list(local_ids)
            sent = len(remote_ids) * remote_size - skipped  # what it holds from our first position on
            arrived = max(min(len(local_ids) * local_size, sent), 0)
            if arrived < len(local_ids) * local_size and (remote_size != local_size or layout != self.kv_cache_layout):
                tokens[req_id] = arrived  # vLLM's covered sub-blocks, in tokens
        return received, engines, tokens, named


def _memories(kv_caches: Mapping[str, Any]) -> dict[str, str]:
    """Layer name -> the name of the first layer whose view is the same memory, shape and
    strides (a hybrid model's groups share their layers' tensors); a layer of its own maps to
    itself. Keys in the caches' order; the values are the memories kvhost describes.

    Two views that start at one address but differ in shape or strides are refused: vLLM
    cuts a ``BHLNC`` buffer for each group by that group's own layer count, so groups of
    unequal counts read each other's blocks in two layouts, and no one description of the
    memory serves both."""
    at: dict[tuple[torch.device, int], str] = {}  # (device, address) -> the first layer there
    memories = {}
    for name, view in kv_caches.items():
        if not isinstance(view, torch.Tensor):
            raise LayoutError(f"layer {name!r} is a {type(view).__name__}, not a tensor view")
        there = memories[name] = at.setdefault((view.device, view.data_ptr()), name)
        seen = kv_caches[there]
        if (seen.shape, seen.stride(), seen.dtype) != (view.shape, view.stride(), view.dtype):
            raise LayoutError(
                f"layers {there!r} and {name!r} view one memory in two ways ({tuple(seen.shape)} with strides "
                f"{seen.stride()}, and {tuple(view.shape)} with strides {view.stride()}): a hybrid model whose KV "
                "cache groups hold unequal layer counts in a layout that puts layers inside blocks (BHLNC) is "
                "not supported; a layout with layers outside blocks (LBNHC, LBHNC, LHBNC) serves it"
            )
    return memories


def _summed(stats: Sequence[ReceiveStats]) -> ReceiveStats | None:
    """Several post-process calls of one step as one (their counts and seconds added)."""
    if not stats:
        return None
    added = [f.name for f in dataclasses.fields(ReceiveStats) if f.name != "backend"]
    return ReceiveStats(backend=stats[0].backend, **{name: sum(getattr(one, name) for one in stats) for name in added})


def _registered_as_rows(kv_caches: Mapping[str, Any]) -> bool:
    """Whether vLLM's ``register_kv_caches`` registers these layer views with NIXL as rows
    of their buffer, one region of a block's bytes of every layer, that kvhost can describe
    as its group's block regions, rather than a region per layer. vLLM registers rows where
    the buffer holds block after block and a layer's ``[H, N, C]`` block is not in order
    (``BLNHC``, ``BHLNC``, of more than one head); kvhost takes them where a row is dense
    (no padding between layers). Only a guess at vLLM's choice: ``_check_region_rearranges``
    compares kvhost's regions with those vLLM registered before a sender is rearranged."""
    first = next(iter(kv_caches.values()), None)
    if not isinstance(first, torch.Tensor) or first.dim() != 4 or first.shape[0] == 0:
        return False
    try:
        storage_bytes = first.untyped_storage().nbytes()
    except RuntimeError:  # a tensor with no storage of its own (a functional or fake tensor)
        return False
    block_stride = first.stride(0) * first.element_size()
    beyond_blocks = storage_bytes - first.shape[0] * block_stride
    dense_row = block_stride == len(kv_caches) * prod(first.shape[1:]) * first.element_size()
    return 0 <= beyond_blocks < block_stride and not first[0].is_contiguous() and dense_row


def _unused(name: str, taken: set[str]) -> str:
    """``name``, primed until no name in ``taken`` is the same. Names made so never meet
    one another: each is an id, a ``/`` and a number of its own, then its primes."""
    while name in taken:
        name += "'"
    return name


class _Registered(NamedTuple):
    """One side's NIXL regions as vLLM registered them: the letters of a block and its
    tokens, then per region the block length, blocks, memory type, address and block
    stride; and the device."""

    letters: str
    tokens: int
    lengths: Sequence[int]
    counts: Sequence[int]
    memories: Sequence[str]
    bases: Sequence[int]
    strides: Sequence[int]
    device: int


def _registered_table(
    engine: str, side: str, regions: _Registered, ours: str, sizes: dict[str, int], itemsize: int
) -> RegionTable:
    """A side's regions as a kvhost table, where each is one of kvhost's block regions
    (``ours``: our region's letters; ``sizes`` without the tokens) in one memory, as many
    blocks in each; refused, naming what was registered, where not."""
    want = prod(sizes.values()) // sizes["N"] * regions.tokens * itemsize
    lengths, counts, memories = regions.lengths, regions.counts, regions.memories
    per_region = (lengths, counts, memories, regions.bases, regions.strides)
    if (
        any(length != want for length in lengths)
        or len(set(counts)) != 1
        or len(set(memories)) != 1
        or len({len(facts) for facts in per_region}) != 1
    ):
        raise LayoutError(
            f"engine {engine!r}: remote blocks larger than ours need NIXL regions that are kvhost's "
            f"block regions ({ours!r}, {want} bytes, as many blocks in each, in one memory); the {side} "
            f"side registered {sorted(set(lengths))} bytes, {sorted(set(counts))} blocks, in "
            f"{sorted(set(memories))}, for {len(lengths)} regions ({len(regions.bases)} addresses, "
            f"{len(regions.strides)} strides)"
        )
    (memory,), (count,) = set(memories), set(counts)
    return _region_table(
        memory,
        regions.letters,
        sizes | {"N": regions.tokens},
        itemsize,
        count,
        regions.bases,
        regions.strides,
        regions.device,
    )


def _region_table(
    memory: str,
    order: str,
    sizes: dict[str, int],
    itemsize: int,
    num_blocks: int,
    bases: Sequence[int],
    strides: Sequence[int],
    device_id: int,
) -> RegionTable:
    """vLLM's NIXL regions as a kvhost table: region ``i`` is stream ``i`` (vLLM pairs
    regions by position), its blocks holding ``order``'s letters."""
    streams = tuple(
        Stream(f"region {i}", (), int(base), int(stride))
        for i, (base, stride) in enumerate(zip(bases, strides, strict=True))
    )
    return RegionTable(memory, int(device_id), order, "", dict(sizes), itemsize, int(num_blocks), streams)


def _in_units(meta: Any, larger: LargerRemoteBlocks, block_size: int) -> Any:
    """The sender's handshake as vLLM should see it: blocks of one unit each, ``runs``
    per block of ours (vLLM's own split of our blocks for smaller remote blocks), its
    block ids expanding to ``units`` unit ids each (as vLLM expands logical block ids).
    Every region holds the count the plan was made for (checked to be one count), and
    vLLM finds a region's descriptors by it."""
    units = larger.units
    blocks = larger.plan.remote.num_blocks * units
    return dataclasses.replace(
        meta,
        block_size=block_size // larger.runs,
        physical_blocks_per_logical_kv_block=meta.physical_blocks_per_logical_kv_block * units,
        num_blocks=blocks,
        region_num_blocks=[blocks] * len(meta.block_lens),
        block_lens=[larger.unit_bytes] * len(meta.block_lens),
        block_strides=[larger.unit_bytes] * len(meta.block_strides),
    )


class KvhostNixlConnector(NixlPullConnector):  # type: ignore[misc]
    """vLLM's NIXL (pull) connector with ``KvhostNixlWorker`` as its worker."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        # NixlPullConnector.__init__ would build vLLM's worker (a NIXL agent) only to drop it;
        # the base leaves both sides None.
        NixlBaseConnector.__init__(self, vllm_config, role, kv_cache_config)
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = NixlPullConnectorScheduler(vllm_config, self.engine_id, kv_cache_config)
        else:
            self.connector_worker = KvhostNixlWorker(vllm_config, self.engine_id, kv_cache_config)


def _note(table: dict[str, Any], engine: str, value: object) -> None:
    """``table[engine] = value``; ``None`` removes the entry."""
    if value is None:
        table.pop(engine, None)
    else:
        table[engine] = value
