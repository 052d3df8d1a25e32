"""Whether a hand-off in chunks of requests beats one transfer then one receive, on one host.

The idea: receive a chunk of requests while the next chunk moves, each chunk small enough
(a few MiB) that its bytes are still in the L3 when the receive reads them, so the receive
would cost less memory traffic and overlap the transfer. Same batch, sender process and
eviction as ``kvhost bench --transfer`` (its ``connect``, ``verify`` and ``measure``);
interleaved rounds, medians, against a memcpy of the same bytes:

    python experiments/handoff_chunks.py [--chunks 4,16] [bench --transfer options]

- ``kvhost-batch``, ``hand-off``: as in the bench (one transfer; then one receive);
- ``chunked/N``: requests in chunks of about N MiB, one transfer each, chunk k received
  while chunk k + 1 moves (posted before the receive starts);
- ``serial/N``: the same chunks, each moved then received, nothing overlapped;
- ``moved/N``: the same chunks' transfers alone, one after another.

Then, outside the rounds, where a transfer's time goes as the batch is cut into more
transfers: NIXL's build (``initialize_xfer``), its post (``transfer``) and the wait after it.
Every chunked way is checked to leave every request's tokens, bit for bit, before timing.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import transfer_rig

import kvhost
from kvhost.caches import CacheSet
from kvhost.nixl import Reader, Transfer
from kvhost.nixl.agent import Link
from kvhost_tools.bench import transfer
from kvhost_tools.bench.sender import TIMEOUT_S, Batch
from kvhost_tools.bench.ways import BATCH, HANDOFF, KVHOST


def chunks_of(batch: Batch, setup: transfer.Setup, chunk_bytes: int) -> list[list[int]]:
    """Consecutive requests grouped until each group holds at least ``chunk_bytes``."""
    groups: list[list[int]] = [[]]
    size = 0
    for i, ids in enumerate(batch.remote_ids):
        if size >= chunk_bytes:
            groups.append([])
            size = 0
        groups[-1].append(i)
        size += setup.plan.bytes_for(len(ids))
    return groups


def ways(setup: transfer.Setup, host: kvhost.KVHost, groups: list[list[int]]) -> dict[str, Callable[[], None]]:
    reader: Reader = setup.readers[KVHOST]
    plan = setup.plan
    requests = setup.batch.requests()
    names, pairs = list(requests), setup.batch.pairs()

    def receive(group: Sequence[int]) -> None:
        batch = {names[i]: requests[names[i]] for i in group}
        host.receive(batch, remote_order=plan.remote_order, remote_block_size=plan.remote_block_size)

    def read(group: Sequence[int]) -> Transfer:
        return reader.read_batch([pairs[i] for i in group])

    def landed(moving: Transfer) -> None:
        moving.wait(TIMEOUT_S)
        moving.release()

    def chunked() -> None:
        moving = read(groups[0])
        for k, group in enumerate(groups):
            landed(moving)
            if k + 1 < len(groups):
                moving = read(groups[k + 1])
            receive(group)

    def threaded() -> None:
        # chunk k + 1 posted from another thread while this one receives chunk k
        with ThreadPoolExecutor(1) as poster:
            moving = poster.submit(read, groups[0])
            for k, group in enumerate(groups):
                landed(moving.result())
                if k + 1 < len(groups):
                    moving = poster.submit(read, groups[k + 1])
                receive(group)

    def serial() -> None:
        for group in groups:
            landed(read(group))
            receive(group)

    def moved() -> None:
        for group in groups:
            landed(read(group))

    return {"chunked": chunked, "threaded": threaded, "serial": serial, "moved": moved}


def post_and_wait(setup: transfer.Setup, counts: Sequence[int], repeats: int) -> None:
    """Medians of NIXL's build, post and wait, the batch cut into ``count`` transfers."""
    reader = setup.readers[KVHOST]
    link = Link(setup.agent, reader.peer)
    pairs = setup.batch.pairs()
    for count in counts:
        groups = np.array_split(np.arange(len(pairs)), count)
        rows = [reader.batch_descriptors([pairs[i] for i in group]) for group in groups]
        spent: dict[str, list[float]] = {"build": [], "post": [], "wait": []}
        for _ in range(repeats):
            setup.peer.evict()
            build = post = wait = 0.0
            for local, remote in rows:
                started = time.perf_counter()
                handle = setup.request((local, remote), reader.peer)
                built = time.perf_counter()
                moving = Transfer.post(link, handle, int(local[:, 1].sum()), "READ", descriptors=local.shape[0])
                posted = time.perf_counter()
                while not moving.poll():  # without pause: the wait's own time is what is timed
                    if time.perf_counter() > posted + TIMEOUT_S:
                        raise RuntimeError(f"a transfer did not finish within {TIMEOUT_S:g} s")
                build, post = build + built - started, post + posted - built
                wait += time.perf_counter() - posted
                moving.release()
            for name, seconds in zip(spent, (build, post, wait)):
                spent[name].append(seconds)
        medians = "  ".join(f"{name} {np.median(s) * 1e3:6.2f} ms" for name, s in spent.items())
        print(f"{count:3d} transfer(s), {sum(r[0].shape[0] for r in rows):,} descriptors: {medians}")


def main(argv: Sequence[str]) -> None:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--chunks", default="4,16", help="chunk sizes, MiB, comma-separated")
    ours, rest = parser.parse_known_args(argv)
    with transfer_rig.connected(rest) as rig:
        setup = rig.setup
        batch, axes = setup.batch, setup.batch.setting.axes
        host = kvhost.KVHost(setup.local, axes=axes)
        merged = setup.transfer(BATCH, rig.args.inflight)

        def handoff() -> None:
            merged()
            transfer.post_process(setup, host)

        methods: dict[str, Callable[[], object]] = {BATCH: merged, HANDOFF: handoff}
        truth = CacheSet(batch.sender_caches(), axes)
        for mib in (int(x) for x in ours.chunks.split(",")):
            groups = chunks_of(batch, setup, mib << 20)
            for name, way in ways(setup, host, groups).items():
                if name != "moved":
                    transfer.fill_sentinel(setup.local)
                    way()
                    transfer.check_tokens(batch, CacheSet(setup.local, axes), truth)
                methods[f"{name}/{mib}MiB ({len(groups)})"] = way
        rig.measure_and_print(methods)
        cuts = sorted({min(count, len(batch.remote_ids)) for count in (1, 2, 4, 8, 40)})  # no empty transfer
        post_and_wait(setup, cuts, repeats=15)


if __name__ == "__main__":
    main(sys.argv[1:])
