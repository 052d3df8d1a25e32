"""What the transfer experiments share: the bench's batch, sender process and eviction
(``kvhost bench --transfer``'s ``connect`` and ``verify``), a memcpy of the batch's bytes,
and interleaved rounds whose medians are printed against that memcpy.

    with transfer_rig.connected(argv) as rig:
        ways = {...}                        # callables, each checked by the experiment
        rig.measure_and_print(ways)
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace

import numpy as np

from kvhost.nixl.hugepages import back_with_huge_pages
from kvhost_tools.bench import transfer
from kvhost_tools.bench.cli import parse
from kvhost_tools.bench.machine import block_ranges
from kvhost_tools.bench.methods import ROOFLINE, Workspace
from kvhost_tools.bench.timing import measure
from kvhost_tools.bench.workloads import PRESETS


@dataclass
class Rig:
    """A connected, verified bench setup (``setup``), its parsed options and its memcpy."""

    args: argparse.Namespace
    setup: transfer.Setup
    device: transfer.BothSides
    memcpy: Callable[[], None]
    ring: np.ndarray  # (address, bytes) of what the memcpy touches

    def measure_and_print(self, ways: Mapping[str, Callable[[], object]], width: int = 24) -> None:
        """Time ``ways`` beside the memcpy in interleaved rounds (the batch's blocks and the
        memcpy's buffers evicted before each call) and print each median, and its fraction."""
        args, batch = self.args, self.setup.batch
        ids = np.array(sorted({b for r in batch.local_ids for b in r}), dtype=np.int64)
        touched = np.concatenate([block_ranges(self.setup.local, batch.setting.axes, ids), self.ring])
        preset = replace(PRESETS["full"], seconds_per_point=args.seconds)
        methods = {ROOFLINE: self.memcpy, **ways}
        rng = random.Random(args.seed)
        samples = measure(methods, self.device, preset, args.rounds, rng, touched).used_samples()
        roof = samples[ROOFLINE].median
        for name, sample in samples.items():
            print(f"{name:{width}s} {sample.median * 1e3:8.2f} ms  {roof / sample.median:.2f} of memcpy")


@contextmanager
def connected(argv: Sequence[str]) -> Iterator[Rig]:
    """``kvhost bench --transfer`` options (``argv``) made into a rig, closed on leaving."""
    args = parse(["--transfer", "--in-process", *argv])
    args.argv = list(argv)
    setup = transfer.connect(args)
    try:
        transfer.verify(setup, args.inflight)
        nbytes = setup.plan.bytes_for(sum(len(r) for r in setup.batch.remote_ids))
        device = transfer.BothSides(args.cache, setup.peer)
        space = Workspace(device)
        ring = space.memcpy_ranges(nbytes, device.device, device.device)
        back_with_huge_pages([(int(address), int(length)) for address, length in ring])
        yield Rig(args, setup, device, space.memcpy(nbytes, device.device, device.device), ring)
    finally:
        for reader in setup.readers.values():
            reader.close()
        setup.agent.close()
        setup.peer.close()
