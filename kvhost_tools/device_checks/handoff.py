"""A NIXL hand-off into a device's memory, side by side with the device's own copy.

    python -m kvhost_tools.device_checks.handoff [--device cuda] [--demo="OPTIONS" ...] [--repeats N] [--out DIR]

The demo's batch (``kvhost bench --transfer``'s: 40 requests of mixed length, block ids in
runs as allocators hand them out, prefill's head-major blocks of 16 tokens, decode's
token-major blocks of 64; ``--demo`` takes the demo's options to change it) moves over NIXL
from the bench's sender process to this one, each cache in the device's memory (VRAM;
host memory with ``--device cpu``, which the tests run), and ``KVHost.receive`` then makes
the landed bytes decode's layout. The sender is a process of its own because UCX reads
device memory between processes (cuda_ipc) and not between two agents of one process,
which it served over TCP loopback at 0.3 GB/s on an H200. Each way is a median of
``--repeats`` with the device synchronized around each, against a device copy of the same
bytes measured in the same run:

- ``per-piece``: one descriptor per sender region (``max_descriptor_bytes=None``), the
  batch as one transfer;
- ``merged``: kvhost's merged descriptors (the default bound), the batch as one transfer;
- ``receive``: the post-process alone, on a ``KVHost`` registered once;
- ``hand-off``: ``merged`` then ``receive``, from the first read to blocks attention can read;
- ``packed``: the sender first copies the batch's blocks, request after request, into one
  buffer of its own laid out like its cache (``KVHost.copy_to`` on its device; the round
  trip to ask for it included), then one transfer reads them: each request's sender blocks
  are then one run, so only the receiver's runs cut descriptors;
- ``hand-off-packed``: ``packed`` then ``receive``;
- ``hand-off-layered``: the same bytes as one transfer per layer (``Reader.read_layers``),
  each layer received as soon as it lands while the next one moves: on a device the copy
  and the receive need not share an engine, so this is where overlap would show;
- ``span/64KiB``, ``span/1MiB``, ``span/layer``: the transport alone, the same number of
  bytes read from one contiguous span of each layer in descriptors of that size (one NIXL
  request made once and posted again): what one descriptor costs against its size.

Before timing, both transfers land the same bytes, and after the receive every request's
blocks hold the sender's tokens bit for bit while blocks no request names keep a sentinel.
Rows are printed and appended to ``DIR/handoff.jsonl`` (with the batch's options) as they
are measured. ``--demo`` again measures another batch after the first; ``--demo=--cross-layer``
gives both caches vLLM's cross-layer layout (``kvhost bench --transfer``'s option).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

import kvhost
from kvhost.caches import CacheSet
from kvhost.nixl import Agent, Reader, plan_transfer
from kvhost.nixl.agent import DEFAULT_THREADS
from kvhost_tools.bench.sender import Batch, Peer, Setting
from kvhost_tools.bench.transfer import Setup, check_tokens, fill_sentinel, hand_off_layered, same_landing
from kvhost_tools.bench.ways import KVHOST, Pair, layered_descriptors, repost, span_name
from kvhost_tools.demo.netenv import QUIET
from kvhost_tools.device_checks.gpucheck import median_seconds, memcpy_seconds

SPANS = (64 << 10, 1 << 20, 0)  # the transport alone: descriptors of these sizes (0: one per layer)
TIMEOUT_S = 60.0  # one batch's transfer (Transfer.wait): a hung transport fails the check instead of hanging it


@dataclass(frozen=True)
class Row:
    way: str
    seconds: float  # median
    bytes: int
    fraction: float  # the device copy's time / this time
    descriptors: int = 0  # descriptors one transfer posted (0: no transfer)

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9


def sender_options(demo: str) -> argparse.Namespace:
    """The bench's sender process with the demo's batch: polled (no progress thread), its
    cache registered with huge pages where it is host memory, in this network namespace."""
    return argparse.Namespace(
        cache="data", demo=demo, progress="poll", huge_pages="on", threads=DEFAULT_THREADS, peer_netns=None
    )


def measure(device: torch.device, demo: str, repeats: int, emit: Callable[[Row], None] | None = None) -> list[Row]:
    """Every way, verified first, then timed; ``emit`` gets each row as it is measured."""
    batch = Batch.of(Setting.parse(demo))
    setting = batch.setting
    axes = setting.axes
    local = setting.model.caches(setting.decode, batch.local_pool, device)
    pairs, requests = batch.pairs(), batch.requests()
    rows: list[Row] = []
    # The sender is a process of its own, as a prefill engine is: UCX reads another
    # process's device memory directly (cuda_ipc), but reads between two agents of one
    # process went over TCP loopback (0.3 GB/s on an H200). The receiver polls its
    # transfers, as a decode engine does.
    with (
        contextlib.closing(Peer(sender_options(demo), {}, device=str(device), pack=True)) as sender,
        Agent("handoff-decode", progress_thread=False) as receiver,
    ):
        local_table = receiver.register(local, axes)
        plan = plan_transfer(local_table, sender.table)
        peer = receiver.add_peer(sender.metadata)
        per_piece, merged = receiver.reader(plan, peer, max_descriptor_bytes=None), receiver.reader(plan, peer)
        assert sender.pack_table is not None
        packed = receiver.reader(plan_transfer(local_table, sender.pack_table), peer)
        packed_pairs = batch.packed_pairs()
        host = kvhost.KVHost(local, axes=axes)
        order, size = plan.remote_order, plan.remote_block_size

        def read(reader: Reader, pairs: Sequence[Pair] = pairs) -> Callable[[], object]:
            def run() -> None:
                transfer = reader.read_batch(pairs)
                transfer.wait(TIMEOUT_S)  # one that does not land stays posted: its agent keeps it
                transfer.release()

            return run

        def receive() -> object:
            return host.receive(requests, remote_order=order, remote_block_size=size)

        def hand_off() -> None:
            read(merged)()
            receive()

        def read_packed() -> None:
            sender.pack()
            read(packed, packed_pairs)()

        def hand_off_packed() -> None:
            read_packed()
            receive()

        ways: dict[str, Callable[[], object]] = {
            "per-piece": read(per_piece),
            "merged": read(merged),
            "receive": receive,
            "hand-off": hand_off,
            "packed": read_packed,
            "hand-off-packed": hand_off_packed,
            "hand-off-layered": hand_off_layered(merged, batch, host, plan),
        }
        merged_count = int(merged.batch_descriptors(pairs)[0].shape[0])
        packed_count = int(packed.batch_descriptors(packed_pairs)[0].shape[0])
        descriptors = {
            "per-piece": int(per_piece.batch_descriptors(pairs)[0].shape[0]),
            "merged": merged_count,
            "receive": 0,
            "hand-off": merged_count,
            "packed": packed_count,
            "hand-off-packed": packed_count,
            "hand-off-layered": layered_descriptors(merged, batch),
        }
        same_landing(local, [ways["per-piece"], ways["merged"], ways["packed"]])
        receive()
        local_set, truth = CacheSet(local, axes), CacheSet(batch.sender_caches(), axes)
        check_tokens(batch, local_set, truth)
        for whole in ("hand-off", "hand-off-packed", "hand-off-layered"):
            fill_sentinel(local)
            ways[whole]()
            check_tokens(batch, local_set, truth)

        def add(row: Row) -> None:
            rows.append(row)
            if emit is not None:
                emit(row)

        nbytes = plan.bytes_for(sum(len(ids) for ids in batch.remote_ids))
        reference = memcpy_seconds(device, nbytes, repeats)
        add(Row("memcpy", reference, nbytes, 1.0))
        for way, run in ways.items():
            seconds = median_seconds(run, device, repeats)
            add(Row(way, seconds, nbytes, reference / seconds, descriptors[way]))
        # The transport alone, the same bytes in descriptors of one size each: its cost per
        # descriptor against the descriptor's size, which bounds what merging can gain.
        connected = Setup(batch, receiver, sender, local, plan, readers={KVHOST: merged})
        made = {span_name(size): connected.span(size, nbytes) for size in SPANS}
        try:
            for name, request in made.items():
                seconds = median_seconds(repost(request), device, repeats)
                add(Row(name, seconds, nbytes, reference / seconds, request.descriptors))
        finally:
            for request in made.values():  # one whose post did not land is kept: its agent holds that post
                request.free()
    return rows


def line(row: Row) -> str:
    posted = f"{row.descriptors:>11}" if row.descriptors else f"{'':>11}"
    return f"{row.way:16} {row.seconds * 1e3:9.3f} {row.gbps:8.1f} {row.fraction:7.2f} {posted}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvhost_tools.device_checks.handoff", description=__doc__ and __doc__.splitlines()[0]
    )
    parser.add_argument("--device", default="cuda", help="where both caches live (default cuda)")
    parser.add_argument(
        "--demo",
        action="append",
        help="the demo's options for the batch (default: its own); again for another batch, measured after",
    )
    parser.add_argument("--repeats", type=int, default=15, help="timed repetitions per way (median)")
    parser.add_argument("--out", help="append each row to DIR/handoff.jsonl as it is measured")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    device = torch.device(args.device)
    for key, value in QUIET.items():  # UCX's and NIXL's chatter, unless asked for
        os.environ.setdefault(key, value)
    out = Path(args.out) if args.out else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "handoff.jsonl").write_text("")
    for demo in args.demo or [""]:

        def emit(row: Row, demo: str = demo) -> None:
            print(line(row), flush=True)
            if out is not None:
                with open(out / "handoff.jsonl", "a") as figures:
                    entry = asdict(row) | {"gbps": row.gbps, "device": str(device), "demo": demo}
                    figures.write(json.dumps(entry) + "\n")

        print(f"batch: {describe(demo)}", flush=True)
        print(f"{'way':16} {'ms':>9} {'GB/s':>8} {'x memcpy':>7} {'descriptors':>11}", flush=True)
        measure(device, demo, args.repeats, emit)
    return 0


def describe(demo: str) -> str:
    """One line for a batch: its options, and both caches as the bench names them."""
    setting = Setting.parse(demo)
    shapes = " -> ".join(shape.describe() for shape in (setting.prefill, setting.decode))
    return f"{demo or 'the demo as it is'}: {shapes}"


if __name__ == "__main__":
    sys.exit(main())
