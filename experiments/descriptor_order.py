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

import sys
import time
from collections.abc import Callable, Sequence

import numpy as np
import transfer_rig

from kvhost.nixl import Transfer
from kvhost.nixl.agent import Link
from kvhost_tools.bench import transfer
from kvhost_tools.bench.sender import TIMEOUT_S
from kvhost_tools.bench.ways import BATCH, KVHOST


def posting(setup: transfer.Setup, rows: tuple[np.ndarray, np.ndarray]) -> Callable[[], None]:
    """One READ of ``rows``, made, posted and polled to the end, as ``read_batch`` does."""
    peer = setup.readers[KVHOST].peer

    def run() -> None:
        handle = setup.request(rows, peer)
        moving = Transfer.post(
            Link(setup.agent, peer), handle, int(rows[0][:, 1].sum()), "READ", descriptors=rows[0].shape[0]
        )
        deadline = time.monotonic() + TIMEOUT_S
        while not moving.poll():
            if time.monotonic() > deadline:
                raise RuntimeError(f"a transfer did not finish within {TIMEOUT_S:g} s")
        moving.release()

    return run


def main(argv: Sequence[str]) -> None:
    with transfer_rig.connected(argv) as rig:
        setup = rig.setup
        local, remote = setup.readers[KVHOST].batch_descriptors(setup.batch.pairs())
        orders = {
            "as planned": np.arange(local.shape[0]),
            "by remote address": np.argsort(remote[:, 0], kind="stable"),
            "by local address": np.argsort(local[:, 0], kind="stable"),
        }
        ways = {BATCH: setup.transfer(BATCH, rig.args.inflight)}
        ways |= {name: posting(setup, (local[order], remote[order])) for name, order in orders.items()}
        # Every order lands what the bench's batch lands, which its own check has verified.
        transfer.same_landing(setup.local, list(ways.values()))
        print(f"{local.shape[0]:,} descriptors")
        rig.measure_and_print(ways, width=20)


if __name__ == "__main__":
    main(sys.argv[1:])
