"""A NIXL connector vLLM loads: vLLM 0.33's own, with kvhost doing its worker's block work.

Pass it to vLLM as::

    --kv-transfer-config '{"kv_connector": "KvhostNixlConnector",
        "kv_connector_module_path": "kvhost.integrations.vllm_connector", "kv_role": "kv_both"}'

It is vLLM's ``NixlConnector`` (the pull connector: handshake, scheduler, NIXL reads,
notifications, failures, all vLLM's code), with a worker that routes three jobs through
kvhost, one call per step each:

- the decode-side post-process: every request of every remote engine that finished
  this step is rearranged from its sender's layout and block size in one
  ``VllmCaches.post_process`` call, each sender with its own transform (vLLM turns one
  permute on for the whole worker), partial last blocks zeroed as vLLM zeroes them;
- the host-buffer staging vLLM uses where NIXL cannot reach device memory (TPU, XPU,
  plugin devices): one save per step for every request to save, one load per step for
  every request received, instead of a copy per request;
- the handshake accepts any remote KVCacheLayout (vLLM refuses all pairs but
  LBHNC -> LBNHC) and block sizes that differ with host buffers too.

This module imports vLLM; ``import kvhost`` and ``kvhost.integrations.vllm`` never
import it, so it is only loaded when vLLM loads it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import (
    NixlBaseConnector,
    NixlPullConnector,
    NixlPullConnectorScheduler,
    NixlPullConnectorWorker,
)

from kvhost.integrations.vllm import RemoteEngine, VllmCaches
from kvhost.stats import ReceiveStats

__all__ = ["KvhostNixlConnector", "KvhostNixlWorker"]


class KvhostNixlWorker(NixlPullConnectorWorker):  # type: ignore[misc]
    """vLLM's pull worker; post-process and host staging are kvhost calls, one per step."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.kvhost: VllmCaches | None = None  # the device caches, once registered
        self.kvhost_host: VllmCaches | None = None  # the host buffers, in host-buffer mode
        # engine -> (its KVCacheLayout, its block size), from its handshake: vLLM may drop an
        # engine's transfer info in the very step that finishes its last request.
        self.remote_engines: dict[str, RemoteEngine] = {}
        self.last_post_process: ReceiveStats | None = None
        self._loads: dict[str, list[int]] = {}

    # --- registration ------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        if self.kvhost is None:  # host-buffer mode made it already, to shape the host buffers
            self.kvhost = VllmCaches(kv_caches, self.kv_cache_layout)
        super().register_kv_caches(kv_caches)

    def initialize_host_xfer_buffer(self, kv_caches: dict[str, Any]) -> None:
        """Host buffers in the device caches' memory order (layer views of one buffer where
        the device's are), so a save or a load is a plain block copy, and what the
        handshake says of our layout is true of the host buffer too."""
        self.kvhost = VllmCaches(kv_caches, self.kv_cache_layout)
        self.host_xfer_buffers = self.kvhost.host_buffers()
        self.host_buffer_kv_cache_layout = self.kv_cache_layout

    # --- handshake ---------------------------------------------------------------------

    def _validate_remote_agent_handshake(self, nixl_agent_meta: Any, remote_tp_size: int, *args: Any) -> None:
        """vLLM's checks, less two refusals kvhost makes moot: another remote KVCacheLayout
        (each sender gets its own transform) and block sizes that differ in host-buffer mode
        (the host buffer is laid out like the device)."""
        theirs = nixl_agent_meta.kv_cache_layout
        self.remote_engines[nixl_agent_meta.engine_id] = RemoteEngine(theirs, nixl_agent_meta.block_size)
        host_mode = bool(getattr(self, "use_host_buffer"))  # noqa: B009 (vLLM's attribute, untyped here)
        nixl_agent_meta.kv_cache_layout = self.host_buffer_kv_cache_layout if host_mode else self.kv_cache_layout
        self.use_host_buffer = False
        try:
            super()._validate_remote_agent_handshake(nixl_agent_meta, remote_tp_size, *args)
        finally:
            nixl_agent_meta.kv_cache_layout = theirs
            self.use_host_buffer = host_mode
        self.enable_permute_local_kv = False  # never one transform for every sender

    # --- host staging ------------------------------------------------------------------

    def save_kv_to_host(self, metadata: Any) -> None:
        """Every request to save this step, in one copy (shared prefix blocks once)."""
        assert self.kvhost is not None
        batch: dict[str, list[int]] = {}
        for req_id, meta in metadata.reqs_to_save.items():
            meta.local_physical_block_ids = self._logical_to_kernel_block_ids(
                meta.local_block_ids, self._physical_blocks_per_logical_kv_block
            )
            batch[req_id] = [b for group in meta.local_physical_block_ids for b in group]
        if batch:
            self.kvhost.save_to_host(self.host_xfer_buffers, batch).wait()

    def sync_recved_kv_to_device(self, req_id: str, meta: Any) -> None:
        """Collected here; loaded for every request of the step in one copy."""
        self._loads[req_id] = [b for group in meta.local_physical_block_ids for b in group]

    # --- post-process --------------------------------------------------------------------

    def post_process_device_kv_on_receive(self, *args: Any, **kwargs: Any) -> None:
        """Replaced by one kvhost call per step (``get_transfer_results``)."""

    def get_transfer_results(self) -> Any:
        receiving = dict(self._recving_metadata)  # vLLM's loop pops what finished
        self._loads = {}
        results = super().get_transfer_results()
        if self._loads:
            assert self.kvhost is not None
            self.kvhost.load_from_host(self.host_xfer_buffers, self._loads).wait()
            self._loads = {}
        done = set(results.finished_recving) - set(results.failed_recving)
        self.last_post_process = self._post_process({r: receiving[r] for r in done if r in receiving})
        return results

    def _post_process(self, finished: Mapping[str, Any]) -> ReceiveStats | None:
        """Every finished request of every engine, rearranged and its tail zeroed at once."""
        if not finished or self.kvhost is None:
            return None
        received: dict[str, dict[str, list[int]]] = {}
        engines: dict[str, RemoteEngine] = {}
        tokens: dict[str, int] = {}
        local_size = self.block_size
        for req_id, meta in finished.items():
            if meta.region_blocks_to_zero is not None or meta.remote is None:
                continue  # vLLM zeroed its read plan's padding itself
            engine = meta.remote.engine_id
            engines[engine] = self.remote_engines[engine]
            layout, remote_size = engines[engine].kv_cache_layout, engines[engine].block_size
            (local_ids,) = meta.local_physical_block_ids  # one attention group (checked at load)
            (remote_ids,) = meta.remote.block_ids
            if not local_ids:
                continue
            received.setdefault(engine, {})[req_id] = list(local_ids)
            arrived = min(len(local_ids) * local_size, len(remote_ids) * remote_size)
            if arrived < len(local_ids) * local_size and (remote_size != local_size or layout != self.kv_cache_layout):
                tokens[req_id] = arrived  # vLLM's covered sub-blocks, in tokens
        if not received:
            return None
        return self.kvhost.post_process(received, engines, tokens=tokens)


class KvhostNixlConnector(NixlPullConnector):  # type: ignore[misc]
    """vLLM's NIXL (pull) connector with ``KvhostNixlWorker`` as its worker."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        # NixlPullConnector.__init__ would build vLLM's worker (a NIXL agent) only to drop it.
        NixlBaseConnector.__init__(self, vllm_config, role, kv_cache_config)
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = NixlPullConnectorScheduler(vllm_config, self.engine_id, kv_cache_config)
            self.connector_worker = None
        elif role == KVConnectorRole.WORKER:
            self.connector_scheduler = None
            self.connector_worker = KvhostNixlWorker(vllm_config, self.engine_id, kv_cache_config)
