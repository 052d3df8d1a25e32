"""Whether the order of a batch's descriptors changes how fast one transfer moves them.

``Reader.read_batch`` posts rows stream by stream (a layer's K or V), each stream's rows in
request order: consecutive descriptors of one stream jump between requests' blocks. Here
the same rows go as they are, sorted by the remote (sender) address, and sorted by the
local address; same batch, sender process and eviction as ``kvhost bench --transfer``,
interleaved rounds, medians, against a memcpy of the same bytes. Each order is checked to
land the same bytes as the bench's batch, before timing:

    python experiments/descriptor_order.py [bench --transfer options]
"""

from __future__ import annotations

import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

import numpy as np

from kvhost.nixl.hugepages import back_with_huge_pages
from kvhost_tools.bench import transfer
from kvhost_tools.bench.cli import parse
from kvhost_tools.bench.machine import block_ranges
from kvhost_tools.bench.methods import ROOFLINE, Workspace
from kvhost_tools.bench.sender import TIMEOUT_S
from kvhost_tools.bench.timing import measure
from kvhost_tools.bench.ways import BATCH, KVHOST, NixlTransfer
from kvhost_tools.bench.workloads import PRESETS


def posting(setup: transfer.Setup, rows: tuple[np.ndarray, np.ndarray]) -> Callable[[], None]:
    """One READ of ``rows``, made, posted and polled to the end, as ``read_batch`` does."""
    nixl, peer = setup.agent.nixl, setup.readers[KVHOST].peer

    def run() -> None:
        handle = setup.request(rows, peer)
        moving = NixlTransfer(nixl, handle, nixl.transfer(handle))
        deadline = time.monotonic() + TIMEOUT_S
        while not moving.poll():
            if time.monotonic() > deadline:
                raise RuntimeError(f"a transfer did not finish within {TIMEOUT_S:g} s")
        moving.release()

    return run


def main(argv: Sequence[str]) -> None:
    args = parse(["--transfer", "--in-process", *argv])
    args.argv = list(argv)
    setup = transfer.connect(args)
    try:
        transfer.verify(setup, args.inflight)
        batch, axes = setup.batch, setup.batch.setting.axes
        nbytes = setup.plan.bytes_for(sum(len(r) for r in batch.remote_ids))
        device = transfer.BothSides(args.cache, setup.peer)
        space = Workspace(device)
        local, remote = setup.readers[KVHOST].batch_descriptors(batch.pairs())
        orders = {
            "as planned": np.arange(local.shape[0]),
            "by remote address": np.argsort(remote[:, 0], kind="stable"),
            "by local address": np.argsort(local[:, 0], kind="stable"),
        }
        methods: dict[str, Callable[[], object]] = {ROOFLINE: space.memcpy(nbytes, device.device, device.device)}
        ring = space.memcpy_ranges(nbytes, device.device, device.device)
        back_with_huge_pages([(int(address), int(length)) for address, length in ring])
        methods[BATCH] = setup.transfer(BATCH, args.inflight)
        for name, order in orders.items():
            methods[name] = posting(setup, (local[order], remote[order]))
        # Every order lands what the bench's batch lands, which its own check has verified.
        transfer.same_landing(setup.local, [methods[BATCH], *(methods[name] for name in orders)])
        ids = np.array(sorted({b for r in batch.local_ids for b in r}), dtype=np.int64)
        touched = np.concatenate([block_ranges(setup.local, axes, ids), ring])
        preset = replace(PRESETS["full"], seconds_per_point=args.seconds)
        measured = measure(methods, device, preset, args.rounds, random.Random(args.seed), touched)
        samples = measured.used_samples()
        roof = samples[ROOFLINE].median
        print(f"{local.shape[0]:,} descriptors")
        for name, sample in samples.items():
            print(f"{name:20s} {sample.median * 1e3:8.2f} ms  {roof / sample.median:.2f} of memcpy")
    finally:
        for reader in setup.readers.values():
            reader.close()
        setup.agent.close()
        setup.peer.close()


if __name__ == "__main__":
    main(sys.argv[1:])
