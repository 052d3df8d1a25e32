"""The demo's batch and the process that sends it, for ``kvhost bench --transfer``.

``Setting`` is the batch as ``--demo`` gives it (the demo's model and workload, both
engines' layouts and block sizes, cross-layer caches or not) and ``Batch`` its block ids on
both sides. The sender (``python -m kvhost_tools.bench.sender``, started by ``Peer``, under
``ip netns exec`` with ``--peer-netns``) fills the prefill cache, registers it with NIXL,
sends its table and agent metadata over a socket pair, and then evicts the blocks read
from it whenever the receiver asks, as the receiver evicts what it touches; with ``--pack``
it also copies the batch's blocks into a buffer of its own when asked (``kvhost-packed``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import select
import shlex
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NoReturn

import numpy as np
import torch

import kvhost
from kvhost.errors import KVHostError
from kvhost.nixl import Agent, RegionTable
from kvhost.nixl.agent import DEFAULT_THREADS
from kvhost.nixl.errors import PeerClosedError, ProtocolError
from kvhost.nixl.framing import receive, send
from kvhost.testing import fill_random
from kvhost_tools.bench.machine import Device, block_ranges
from kvhost_tools.demo.config import (
    LAYOUTS,
    EngineShape,
    Model,
    Workload,
    allocate_blocks,
    blocks_for,
    local_blocks_for,
    model_refusal,
    pool_for,
)
from kvhost_tools.demo.options import add_model, add_workload, default_layout, model_of, workload_of
from kvhost_tools.demo.stopping import stop_on_sigterm, stopped_by

QUICK_DEMO = "--layers 2 --heads 2 --head-dim 16 --requests 8 --min-tokens 5 --max-tokens 150"
TIMEOUT_S = 120.0  # any one control message, and any one transfer
# How each side drives NIXL: "poll" (no progress thread; the receiver polls its transfers,
# the sender asks for notifications every POLL_S while it waits), or NIXL's progress
# thread on both sides, which polls without pause (half a core each when idle, here).
PROGRESS = ("poll", "thread")
# Whether both sides ask for huge pages under their registered caches (and under memcpy's
# buffers): Agent.register's default, or memory as the allocator left it.
HUGE_PAGES = ("on", "off")
POLL_S = 1e-4
IDLE_S = 24 * 3600.0  # the longest the sender waits for the receiver's next message
SEED = 1000  # the sender's layer i holds fill_random(seed SEED + i)


class _DemoParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise ValueError(message)  # the caller names the option: ``kvhost bench`` refuses it with status 2


@dataclass(frozen=True)
class Setting:
    """The demo's batch as ``--demo`` gives it: the model, the workload (with how both sides'
    allocators hand out block ids) and both engines' caches (one rank each)."""

    model: Model
    workload: Workload
    prefill: EngineShape
    decode: EngineShape

    @classmethod
    def parse(cls, text: str) -> Setting:
        """The setting of ``text``; options it cannot read end the program, naming them."""
        try:
            return cls.read(text)
        except ValueError as err:
            raise SystemExit(f"kvhost bench --demo: {err}") from None

    @classmethod
    def read(cls, text: str) -> Setting:
        """The setting of ``text``, or a ValueError saying which option it cannot read."""
        p = _DemoParser(prog="kvhost bench --demo", add_help=False)
        add_model(p)
        add_workload(p)
        p.add_argument("--prefill-layout", choices=sorted(LAYOUTS), default=None)
        p.add_argument("--prefill-block-size", type=int, default=16)
        p.add_argument("--decode-layout", choices=sorted(LAYOUTS), default=None)
        p.add_argument("--decode-block-size", type=int, default=64)
        p.add_argument("--cross-layer", action="store_true")  # both caches: a block's layers back to back
        args = p.parse_args(shlex.split(text))
        prefill_layout = default_layout(args.cache, args.prefill_layout, "HND")
        decode_layout = default_layout(args.cache, args.decode_layout, "NHD")
        prefill = EngineShape(prefill_layout, args.prefill_block_size, cross_layer=args.cross_layer)
        decode = EngineShape(decode_layout, args.decode_block_size, cross_layer=args.cross_layer)
        return cls(model_of(args), workload_of(args), prefill, decode)

    @property
    def axes(self) -> str:
        return self.model.axes_for(self.prefill)  # both sides cross-layer, or neither

    def refusal(self) -> str | None:
        """Why the demo itself would refuse this batch (one line naming the option), or None."""
        problem = model_refusal(self.model, self.workload, [("prefill-", self.prefill), ("decode-", self.decode)])
        if problem:
            return problem
        big, small = sorted((self.prefill.block_size, self.decode.block_size), reverse=True)
        if big % small:
            sizes = f"--prefill-block-size {self.prefill.block_size} and --decode-block-size {self.decode.block_size}"
            return f"{sizes} must divide one another"
        return None


@dataclass(frozen=True)
class Batch:
    """The demo's batch: per request, the sender's block ids and the receiver's."""

    setting: Setting
    remote_pool: int
    local_pool: int
    remote_ids: list[list[int]]
    local_ids: list[list[int]]

    @classmethod
    def of(cls, setting: Setting) -> Batch:
        prefill, decode, workload = setting.prefill, setting.decode, setting.workload
        needed = [blocks_for(t, prefill.block_size) for t in workload.lengths()]
        local_needed = [local_blocks_for(n, prefill.block_size, decode.block_size) for n in needed]
        remote_pool, local_pool = pool_for(needed), pool_for(local_needed)
        remote_ids, _ = allocate_blocks(remote_pool, needed, workload, stream=2)
        local_ids, _ = allocate_blocks(local_pool, local_needed, workload, stream=3)
        return cls(setting, remote_pool, local_pool, remote_ids, local_ids)

    def sender_caches(self, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
        """The sender's cache, filled as the sender fills it (seeded)."""
        caches = self.setting.model.caches(self.setting.prefill, self.remote_pool, device)
        for i, tensor in enumerate(caches.values()):
            fill_random(tensor, SEED + i)
        return caches

    def requests(self) -> dict[str, list[int]]:
        """The receiver's block ids by request name, as ``kvhost.receive`` takes them."""
        return {f"req-{i:03d}": ids for i, ids in enumerate(self.local_ids)}

    def pairs(self) -> list[tuple[list[int], list[int]]]:
        """(local ids, remote ids) per request, as a ``Reader`` takes them."""
        return list(zip(self.local_ids, self.remote_ids))

    @property
    def packed_blocks(self) -> int:
        return sum(len(ids) for ids in self.remote_ids)

    def packed_pairs(self) -> list[tuple[list[int], list[int]]]:
        """(local ids, ids in the sender's pack buffer) per request: the batch's sender blocks
        copied, request after request, to blocks 0, 1, 2, ... of a buffer laid out like the
        sender's cache (``--pack``), so that each request's blocks are one run there."""
        pairs, at = [], 0
        for local_ids, remote_ids in self.pairs():
            pairs.append((local_ids, list(range(at, at + len(remote_ids)))))
            at += len(remote_ids)
        return pairs


def main(argv: Sequence[str]) -> int:
    """``peer_main``, ended quietly where the bench stopped it (SIGTERM, or Ctrl-C on a terminal
    both share) or is gone (its end of the socket closed): the bench says what happened."""
    try:
        with stop_on_sigterm():
            return peer_main(argv)
    except KeyboardInterrupt as err:
        return stopped_by(err)[1]
    except PeerClosedError:  # nobody is left to read from this sender
        return 1


def peer_main(argv: Sequence[str]) -> int:
    """The sender: ``--fd N`` (its end of the socket pair), ``--cache``, ``--device`` (where its
    cache lives) and the demo's options. With ``--pack`` it also registers a pack buffer laid
    out like its cache, with a block for each block of the batch, and on ``pack`` copies the
    batch's blocks into it (``Batch.packed_pairs``) before it answers ``packed``: what a
    prefill engine would do before offering blocks, so that a reader needs fewer descriptors."""
    parser = argparse.ArgumentParser(prog="python -m kvhost_tools.bench.sender")
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--cache", default="data")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--demo", default="")
    parser.add_argument("--progress", choices=PROGRESS, default="poll")
    parser.add_argument("--huge-pages", choices=HUGE_PAGES, default="on")
    parser.add_argument("--threads", type=int, default=DEFAULT_THREADS)
    parser.add_argument("--pack", action="store_true")
    args = parser.parse_args(argv)
    batch = Batch.of(Setting.parse(args.demo))
    axes = batch.setting.axes
    caches = batch.sender_caches(args.device)
    device = Device("cpu", args.cache)
    thread = args.progress == "thread"
    agent = Agent(f"bench-prefill-{os.getpid()}", progress_thread=thread, threads=args.threads)
    with socket.socket(fileno=args.fd) as sock, agent:
        huge_pages = args.huge_pages == "on"
        table = agent.register(caches, axes, huge_pages=huge_pages)
        hello = {"table": table.to_dict(), "pid": os.getpid(), "huge_pages": agent.huge_pages.describe()}
        ids = np.array(sorted({b for r in batch.remote_ids for b in r}), dtype=np.int64)
        # Only host memory is evicted (what the bench asks for); a device's cache is read as it is.
        touched = block_ranges(caches, axes, ids) if args.device == "cpu" else None
        if args.pack:
            pack = batch.setting.model.caches(batch.setting.prefill, batch.packed_blocks, args.device)
            hello["pack_table"] = agent.register(pack, axes, huge_pages=huge_pages).to_dict()
            packer = Packer(kvhost.KVHost(caches, axes=axes), pack, batch)
            if touched is not None:
                every = np.arange(batch.packed_blocks, dtype=np.int64)
                touched = np.concatenate([touched, block_ranges(pack, axes, every)])
        send(sock, "hello", hello, agent.metadata(), timeout=TIMEOUT_S)
        while True:
            until = time.monotonic() + IDLE_S
            if not thread:  # drive the transport while no control message waits, up to the idle bound
                while not select.select([sock], [], [], POLL_S)[0] and time.monotonic() < until:
                    agent.nixl.get_new_notifs()
            message = receive(sock, timeout=max(until - time.monotonic(), 0.0))
            if message.kind == "evict":
                if touched is None:
                    raise KVHostError(f"evict: the sender's cache is in {args.device} memory, which is not evicted")
                device.flush(touched)
                send(sock, "evicted", {}, timeout=TIMEOUT_S)
            elif message.kind == "pack":
                if not args.pack:  # exiting closes the socket: the receiver hears it at once
                    raise KVHostError("pack: this sender was started without --pack")
                packer.pack()
                send(sock, "packed", {}, timeout=TIMEOUT_S)
            elif message.kind == "quit":
                return 0


class Packer:
    """The sender's copy of the batch's blocks into its pack buffer, done when ``pack`` returns."""

    def __init__(self, host: kvhost.KVHost, pack: dict[str, torch.Tensor], batch: Batch) -> None:
        self.host, self.pack_caches = host, pack
        self.ids = [b for ids in batch.remote_ids for b in ids]
        self.device = next(iter(pack.values())).device

    def pack(self) -> None:
        self.host.copy_to(self.pack_caches, self.ids, range(len(self.ids))).wait()
        if self.device.type != "cpu":
            torch.accelerator.synchronize(self.device)


class Peer:
    """The sender process, and the control socket to it; ``device``: where its cache lives."""

    def __init__(
        self, args: argparse.Namespace, env: dict[str, str], device: str = "cpu", *, pack: bool = False
    ) -> None:
        ours, theirs = socket.socketpair()
        command = [sys.executable, "-m", "kvhost_tools.bench.sender", "--fd", str(theirs.fileno())]
        command += ["--cache", args.cache, "--device", device, f"--demo={args.demo}", "--progress", args.progress]
        command += ["--huge-pages", args.huge_pages, "--threads", str(args.threads), *(["--pack"] if pack else [])]
        netns = args.peer_netns
        if netns:
            command = ["ip", "netns", "exec", netns, *command]
        self.process = subprocess.Popen(command, pass_fds=[theirs.fileno()], env=dict(os.environ, **env))
        theirs.close()
        self.sock = ours
        try:
            hello = receive(ours, timeout=TIMEOUT_S, expect="hello")
            fields = hello.fields()
            self.table = RegionTable.from_dict(fields.data["table"], "hello.table", hello.arrays)
            packed = fields.data.get("pack_table")
            self.pack_table = (
                None if packed is None else RegionTable.from_dict(packed, "hello.pack_table", hello.arrays)
            )
            self.metadata = hello.blob
            self.pid = fields.integer("pid")
            self.huge_pages = str(fields.data["huge_pages"])
        except BaseException:  # it failed to start, or the bench was stopped meanwhile: it must not outlive us
            self.sock.close()
            self.process.terminate()
            self._wait()
            raise

    def evict(self) -> None:
        send(self.sock, "evict", {}, timeout=TIMEOUT_S)
        receive(self.sock, timeout=TIMEOUT_S, expect="evicted")

    def pack(self) -> None:
        """The sender copies the batch's blocks into its pack buffer (``--pack``), and says so."""
        send(self.sock, "pack", {}, timeout=TIMEOUT_S)
        receive(self.sock, timeout=TIMEOUT_S, expect="packed")

    def close(self) -> None:
        with contextlib.suppress(OSError, ProtocolError):  # a sender that has already exited
            send(self.sock, "quit", {}, timeout=5.0)
        self.sock.close()
        self._wait()

    def _wait(self) -> None:
        """Wait for the sender to exit: 30 s, then it is killed."""
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
