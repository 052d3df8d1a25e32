"""kvhost.nixl.agent: an Agent's life (registration, peers, readers, close), the memory one
merged descriptor may span (``merge_domains``), and a Transfer's states.

Everything NIXL can show runs against real NIXL agents (UCX, in this process). A Transfer's
states that a loopback transfer cannot be made to show on demand (still in flight when
polled, an error state, a call that raises) are driven by ``ScriptedNixl``, which stands in
for the two calls a Transfer makes and answers them from a script.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import re
import subprocess
import sys
import threading
import time
import weakref
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from test_nixl import caches_for, memmove_rows, needs_nixl

from kvhost.caches import CacheSet
from kvhost.errors import ArgumentError, LayoutError
from kvhost.nixl import Agent, NixlUnavailableError, ProtocolError, TransferError, plan_transfer, region_table
from kvhost.nixl.agent import (
    DEFAULT_THREADS,
    MAX_PEER_NAME,
    MAX_THREADS,
    Link,
    Probes,
    Transfer,
    _hold,
    _peer_name,
    layer_by_layer,
    merge_domains,
    post_all,
    post_rows,
    release_all,
)
from kvhost.nixl.plans import extent_rows, stream_extents
from kvhost.nixl.ucx import UCX_CUDA_DEFAULTS, _cuda_driver_loads
from kvhost.testing import raw

SIZES = dict(K=2, H=2, C=8)


@pytest.fixture(autouse=True)
def _no_stand_in_agent_held():
    """The module holds every agent with a transfer that may write: the stand-ins the
    scripted tests post with are let go after each test (real agents close)."""
    from kvhost.nixl.agent import _HOLDING, _WRITING

    yield
    for key, agent in list(_HOLDING.items()):
        if not isinstance(agent, Agent):
            del _HOLDING[key]
            _WRITING.pop(key, None)


MINE = "NIXL_INIT_AGENT"  # NIXL's name for the agent's own memory (kvhost.nixl.agent.NIXL_LOCAL_AGENT)


def ended(agent):
    """Whether ``close`` ended the NIXL agent itself: its UCX worker, threads and connections,
    and with them all it had registered and loaded."""
    return not hasattr(agent.nixl, "agent")


def nixl_accepts(agent, owner, rows, memory="DRAM"):
    assert not ended(agent), "a NIXL agent that close ended was asked"
    try:
        agent.nixl.prep_xfer_dlist(owner, rows, memory).release()
    except Exception:
        return False
    return True


class Spy:
    """Wraps one method of a real NIXL agent: records each call's arguments, then makes it."""

    def __init__(self, monkeypatch, nixl, name):
        self.calls = []
        real = getattr(nixl, name)

        def record(*args):
            self.calls.append(args)
            return real(*args)

        monkeypatch.setattr(nixl, name, record)


# --- an Agent's life ------------------------------------------------------------------------


@needs_nixl
def test_a_closed_agent_refuses_every_call_and_closes_twice():
    agent = Agent("closing")
    caches = caches_for("KBNHC", "KBNHC", SIZES, 4, 4, seed=1)
    agent.close()
    agent.close()  # the second finds nothing left to undo
    for call in (
        lambda: agent.metadata(),
        lambda: agent.register(caches, "KBNHC"),
        lambda: agent.add_peer(b"nixl"),
        lambda: agent.reader(None, "anyone"),
    ):
        with pytest.raises(TransferError, match="agent 'closing' is closed"):
            call()


@needs_nixl
@pytest.mark.timeout(60)
def test_close_waits_for_a_post_under_way_on_another_thread_and_refuses_later_ones(monkeypatch):
    """A post that passed the open check before another thread's close began is waited for:
    close deregistering the memory, or dropping the peer, under it crashed NIXL's post."""
    import kvhost.nixl.agent as agent_module

    agent = Agent("closing-under-a-post")
    table = agent.register(caches_for("KBNHC", "KBNHC", SIZES, 4, 4, seed=12), "KBNHC")
    rows = extent_rows(table)[:1]
    entered, go_on, order = threading.Event(), threading.Event(), []
    real = agent.nixl.initialize_xfer

    def held(*args):
        entered.set()
        go_on.wait(30)
        order.append("post")
        return real(*args)  # no such peer: NIXL refuses, and the post ends

    monkeypatch.setattr(agent.nixl, "initialize_xfer", held)
    deregister = agent.nixl.deregister_memory
    monkeypatch.setattr(agent.nixl, "deregister_memory", lambda *a: order.append("deregister") or deregister(*a))
    failures = []

    def post():
        try:
            post_rows(agent, "x", "READ", rows, rows, ("DRAM", "DRAM"))
        except TransferError as err:
            failures.append(str(err))

    poster = threading.Thread(target=post)
    poster.start()
    assert entered.wait(10)
    monkeypatch.setattr(agent_module, "CLOSE_WAIT_SECONDS", 0.2)
    with pytest.raises(TransferError, match=r"'closing-under-a-post': 1 post\(s\) still under way after 0.2 s") as late:
        agent.close()
    assert late.value.timed_out
    assert nixl_accepts(agent, MINE, extent_rows(table)), "the memory was deregistered under a post"
    monkeypatch.setattr(agent_module, "CLOSE_WAIT_SECONDS", 30.0)
    threading.Timer(0.3, go_on.set).start()
    started = time.monotonic()
    agent.close()  # waits for the post, and is told at once when it ends
    assert time.monotonic() - started < 5
    poster.join(10)
    assert order == ["post", "deregister"] and "creating the transfer failed" in failures[0]
    with pytest.raises(TransferError, match="agent 'closing-under-a-post' is closed"):
        post_rows(agent, "x", "READ", rows, rows, ("DRAM", "DRAM"))
    started = time.monotonic()
    agent.close()  # a refused post counted nothing: a second close waits for none
    assert time.monotonic() - started < 5


@needs_nixl
def test_worker_threads_reach_nixl_and_bad_counts_are_refused():
    """``threads`` is NIXL's num_threads for UCX: the default (vLLM's), none, or a count given,
    up to and including the most an agent takes."""
    accepted = ((None, {"num_threads": str(DEFAULT_THREADS)}), (0, {}), (3, {"num_threads": "3"}))
    for threads, params in (*accepted, (MAX_THREADS, {"num_threads": str(MAX_THREADS)})):
        options = {} if threads is None else {"threads": threads}
        with Agent(f"threads-{threads}", progress_thread=False, **options) as agent:
            assert agent.nixl.get_backend_params("UCX") == params
    for bad in (True, -1, MAX_THREADS + 1, 2.0, "4"):
        with pytest.raises(ArgumentError, match=rf"threads {bad!r} must be an integer from 0 to {MAX_THREADS}"):
            Agent("threads-bad", threads=bad)
    for bad in ("no", 0, None):  # flags: "no" was taken as yes
        with pytest.raises(ArgumentError, match=rf"progress_thread must be True or False, got {bad!r}"):
            Agent("flag-bad", progress_thread=bad)
        with Agent("flag-register", progress_thread=False) as agent:
            with pytest.raises(ArgumentError, match=rf"huge_pages must be True or False, got {bad!r}"):
                agent.register({"l": torch.zeros(2, 4, 16)}, "BNC", huge_pages=bad)
            assert not agent._registered  # refused before NIXL was asked
    for name in (None, b"bytes", ""):
        with pytest.raises(ArgumentError, match="an agent's name must be a non-empty str"):
            Agent(name, progress_thread=False)  # type: ignore[arg-type]
    for backends in ("UCX", None, [b"UCX"]):  # a str was iterated letter by letter
        with pytest.raises(ArgumentError, match="backends must be a list of NIXL backend names"):
            Agent("backends-bad", backends=backends, progress_thread=False)  # type: ignore[arg-type]


@needs_nixl
def test_readers_refuse_what_is_no_agent_plan_or_peer_name():
    """A Reader made directly, not by ``Agent.reader``, checks what it is given as that does:
    wrong kinds were a TransferError quoting pybind, or an AttributeError."""
    from kvhost.nixl import RankReader, Reader, plan_ranks

    cache = {"l": torch.zeros(2, 4, 16, 2, 8)}
    with Agent("reader-kinds", progress_thread=False) as agent:
        table = agent.register(cache, "KBNHC", huge_pages=False)
        plan = plan_transfer(table, table)
        ranks = plan_ranks(table, 0, 1, [table])
        for args, said in (
            ((None, plan, "peer"), "a Reader takes an Agent and a TransferPlan"),
            ((agent, None, "peer"), "a Reader takes an Agent and a TransferPlan"),
            ((agent, plan, True), "a peer is named by the text add_peer returned, got True"),
        ):
            with pytest.raises(ArgumentError, match=said):
                Reader(*args)  # type: ignore[arg-type]
        with pytest.raises(ArgumentError, match="a RankReader takes a RankPlan"):
            RankReader(agent, None, {0: "peer"})  # type: ignore[arg-type]
        with pytest.raises(ArgumentError, match="a peer is named by the text add_peer returned, got True"):
            RankReader(agent, ranks, {0: True})  # type: ignore[dict-item]


@needs_nixl
@pytest.mark.parametrize("driver", [True, False])
def test_an_agent_gives_ucx_cuda_ipc_reads_unless_the_environment_says_otherwise(monkeypatch, driver):
    """Without cuda_ipc's get, a read of another process's VRAM on a GPU without NVLink goes
    over TCP loopback; an operator's own setting is left as it is, and where the CUDA driver
    does not load (UCX's CUDA transports with it) nothing is set for UCX to warn about."""
    key = "UCX_CUDA_IPC_ENABLE_GET_ZCOPY"
    assert {key: "on"} == UCX_CUDA_DEFAULTS
    monkeypatch.setattr("kvhost.nixl.ucx._cuda_driver_loads", lambda: driver)
    monkeypatch.delenv(key, raising=False)
    with Agent("ucx-defaults", progress_thread=False):
        assert os.environ.get(key) == ("on" if driver else None)
    monkeypatch.setenv(key, "off")
    with Agent("ucx-operator", progress_thread=False):
        assert os.environ[key] == "off"


@needs_nixl
@pytest.mark.parametrize("operator", [None, "1"])
def test_an_agent_leaves_sighup_to_the_process_unless_the_operator_gives_it_to_ucx(operator):
    """UCX catches SIGHUP for its debug mode by default when a worker starts (a hang-up then
    leaves the engine running, logging at DEBUG level); an Agent tells it not to, unless the
    environment names a signal for it."""
    env = {k: v for k, v in os.environ.items() if k != "UCX_DEBUG_SIGNO"}
    if operator is not None:
        env["UCX_DEBUG_SIGNO"] = operator
    script = """
import signal
from kvhost.nixl import Agent
def caught():
    line = next(l for l in open("/proc/self/status") if l.startswith("SigCgt:"))
    return bool(int(line.split()[1], 16) >> (signal.SIGHUP - 1) & 1)
before = caught()
with Agent("sighup", progress_thread=False):
    print("SIGHUP caught:", before, caught())
"""
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    (said,) = [line for line in done.stdout.splitlines() if line.startswith("SIGHUP caught:")]  # NIXL says more
    assert said.split()[2:] == ["False", "True" if operator else "False"]


def test_the_cuda_driver_probe_answers_what_loading_it_does(monkeypatch):
    calls: list[str] = []
    _cuda_driver_loads.cache_clear()
    monkeypatch.setattr(ctypes, "CDLL", calls.append)
    assert _cuda_driver_loads() is True and calls == ["libcuda.so.1"]

    def refuse(name):
        raise OSError(f"{name}: cannot open shared object file")

    _cuda_driver_loads.cache_clear()
    monkeypatch.setattr(ctypes, "CDLL", refuse)
    assert _cuda_driver_loads() is False
    _cuda_driver_loads.cache_clear()


FROZEN_SENDER = """
import os, sys, time
sys.path.insert(0, "tests")
from test_nixl import caches_for
from kvhost.nixl import Agent
from kvhost.nixl.framing import encode
agent = Agent("frozen-sender")
table = agent.register(caches_for("KBNHC", "KBHNC", dict(K=2, H=2, C=8), 16, int(sys.argv[2]), seed=5), "KBNHC")
with open(sys.argv[1] + ".part", "wb") as out:
    out.write(encode("table", {"table": table.to_dict()}, agent.metadata()))
os.rename(sys.argv[1] + ".part", sys.argv[1])
time.sleep(120)
"""


@contextlib.contextmanager
def frozen_sender_reading(tmp_path, monkeypatch, name, blocks=4096):
    """An agent reading every block of a sender that was stopped (SIGSTOP) first: the read is
    in flight until the sender runs again. Yields the sender, the agent, the read, the local
    tensors (as weak references), the plan of the read, and the bytes the read lands once the sender runs. The
    sender is killed at the end, never left behind."""
    import signal
    import subprocess
    import sys

    from kvhost.nixl import RegionTable
    from kvhost.nixl.framing import decode

    # Both sides over TCP, which has no remote read: the sender's UCX answers each read, so
    # frozen it serves none. Over shared memory the reader may copy from the sender's memory
    # itself (a read landed in 1.4 ms from a stopped sender once, on a loaded machine).
    monkeypatch.setenv("UCX_TLS", "tcp")
    frame = tmp_path / "sender.frame"
    sender = subprocess.Popen([sys.executable, "-c", FROZEN_SENDER, str(frame), str(blocks)], cwd=os.getcwd())
    try:
        deadline = time.monotonic() + 60
        while not frame.exists() and sender.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        message = decode(frame.read_bytes())
        remote = RegionTable.from_dict(message.header["table"], "table", message.arrays)
        caches = caches_for("KBNHC", "KBNHC", SIZES, 16, blocks, seed=6)
        # What the read lands: the sender's bytes (its caches, made again here) moved as NIXL would.
        landed = {name: t.clone() for name, t in caches.items()}
        sent = caches_for("KBNHC", "KBHNC", SIZES, 16, blocks, seed=5)
        memmove_rows(
            *plan_transfer(region_table(landed, "KBNHC"), region_table(sent, "KBNHC")).descriptor_pairs(
                range(blocks), range(blocks)
            )
        )
        agent = Agent(name)
        local = agent.register(caches, "KBNHC")
        alive = [weakref.ref(t) for t in caches.values()]
        del caches
        reader = agent.reader(plan_transfer(local, remote), agent.add_peer(message.blob))
        os.kill(sender.pid, signal.SIGSTOP)
        transfer = reader.read(range(blocks), range(blocks))
        assert transfer.poll() is False and agent.posted == {transfer}, "the read landed: nothing is in flight"
        run = SimpleNamespace(
            sender=sender, agent=agent, transfer=transfer, plan=reader.plan, local=local, alive=alive, landed=landed
        )
        del agent, reader, transfer  # the test's to drop
        yield run
    finally:
        sender.kill()
        sender.wait()


@needs_nixl
@pytest.mark.timeout(120)
def test_a_read_in_flight_is_never_freed_and_lands_in_memory_kept_for_it(tmp_path, monkeypatch):
    """NIXL's release of a read in flight returns as if it had cancelled it, yet the read
    lands once the peer runs again: released memory would be written after it was freed
    (that crashed a process here), and NIXL's keys freed under the read corrupted the heap.
    So neither release nor close lets go of it: the agent, its memory and its tensors are
    kept, whoever drops them, until the read lands; then close lets go of everything."""
    import signal

    from kvhost.nixl.agent import _HOLDING

    with frozen_sender_reading(tmp_path, monkeypatch, "closing-under-a-read") as run:
        agent, transfer = run.agent, run.transfer
        with pytest.raises(TransferError, match="'frozen-sender' is still in flight and cannot be cancelled"):
            transfer.release()
        assert not transfer.released and agent.uncancelled == [transfer] and agent.posted == {transfer}
        with pytest.raises(TransferError, match=r"1 transfer\(s\) from \['frozen-sender'\] still in flight may write"):
            agent.close()
        assert nixl_accepts(agent, MINE, extent_rows(run.local)), "the memory was deregistered under the read"
        with pytest.raises(TransferError, match="'frozen-sender' has 1 transfer\\(s\\) posted and not released"):
            agent.remove_peer("frozen-sender")
        held = weakref.ref(agent)
        del agent, transfer, run.agent, run.transfer
        gc.collect()
        agent = held()
        assert id(agent) in _HOLDING and all(ref() is not None for ref in run.alive), "dropped under the read"
        (transfer,) = agent.uncancelled
        os.kill(run.sender.pid, signal.SIGCONT)
        transfer.wait(60)
        landed = [raw(ref()) for ref in run.alive]
        assert all(torch.equal(a, raw(b)) for a, b in zip(landed, run.landed.values())), "not the sender's bytes"
        del landed
        agent.close()
        assert transfer.released and agent.posted == set() and agent.uncancelled == [] and id(agent) not in _HOLDING
        assert ended(agent), "the NIXL agent outlived close"
        gc.collect()
        assert all(ref() is None for ref in run.alive)


@needs_nixl
@pytest.mark.timeout(120)
def test_a_read_in_flight_from_a_peer_that_dies_fails_and_then_close_lets_go(tmp_path, monkeypatch):
    """The peer dies under the read (killed while stopped): the read fails on the wire, and
    only then does close let go of the peer's keys and the memory, and the agent is freed.
    A second read from the same peer, its state asked after the first failed (when NIXL
    may have let go of the peer), fails the same way: nothing is left held for ever."""
    from kvhost.nixl.agent import _HOLDING

    with frozen_sender_reading(tmp_path, monkeypatch, "closing-after-a-death") as run:
        agent, transfer = run.agent, run.transfer
        second = agent.reader(run.plan, "frozen-sender").read(range(8), range(8))
        with pytest.raises(TransferError, match="still in flight may write"):
            agent.close()
        run.sender.kill()
        run.sender.wait()
        for read in (transfer, second):
            with pytest.raises(TransferError, match="'frozen-sender' failed: NIXL_ERR_REMOTE_DISCONNECT"):
                read.wait(60)
        del read, second
        agent.close()
        assert transfer.released and agent.uncancelled == [] and id(agent) not in _HOLDING
        assert ended(agent), "the NIXL agent outlived close"
        held = weakref.ref(agent)
        del agent, transfer, run.agent, run.transfer
        gc.collect()
        assert held() is None and all(ref() is None for ref in run.alive)


@needs_nixl
@pytest.mark.timeout(60)
def test_an_agent_keeps_no_reader_closed_or_dropped():
    """A long-lived agent making readers (one per peer or plan) holds none it was given back."""
    with Agent("keeps-no-readers-sender") as sender, Agent("keeps-no-readers") as receiver:
        remote = sender.register(caches_for("KBNHC", "KBHNC", SIZES, 4, 8, seed=2), "KBNHC")
        local = receiver.register(caches_for("KBNHC", "KBNHC", SIZES, 16, 4, seed=3), "KBNHC")
        peer = receiver.add_peer(sender.metadata())
        closed, dropped, kept = (receiver.reader(plan_transfer(local, remote), peer) for _ in range(3))
        closed.close()
        del dropped
        gc.collect()
        assert set(receiver._readers) == {kept}
    assert kept.closed  # closed with its agent


@needs_nixl
@pytest.mark.timeout(60)
@pytest.mark.parametrize("change", ["set_", "resize_"])
def test_registered_memory_that_moved_is_refused_before_any_read_or_offer(change):
    """NIXL moves bytes at the addresses registered: a tensor re-pointed (``set_``) or grown
    (``resize_``, which frees its old memory) since would have a peer's bytes land in
    whatever lies there now. Every read, batch, layered read and the metadata a peer is
    offered are refused first, naming the layer; the memory a re-pointed tensor let go of
    stays held until the agent closes."""
    with Agent("moved-sender") as sender, Agent("moved-receiver") as receiver:
        remote_table = sender.register(caches_for("KBNHC", "KBHNC", SIZES, 4, 8, seed=2), "KBNHC")
        local = caches_for("KBNHC", "KBNHC", SIZES, 16, 4, seed=3)
        plan = plan_transfer(receiver.register(local, "KBNHC"), remote_table)
        reader = receiver.reader(plan, receiver.add_peer(sender.metadata()))
        moved = next(iter(local.values()))
        held = weakref.ref(moved.untyped_storage())
        if change == "set_":
            moved.set_(torch.zeros_like(moved))
        else:
            moved.untyped_storage().resize_(moved.untyped_storage().nbytes() * 2)
        gc.collect()
        assert held() is not None or change == "resize_", "the memory NIXL may still move bytes at was freed"
        refused = r"agent 'moved-receiver': registered memory changed: .*layer 'l0'\[0\] changed since"
        for call in (
            lambda: reader.read([0], [0, 1, 2, 3]),
            lambda: reader.read_batch([([0], [0, 1, 2, 3])]),
            lambda: reader.read_layers([([0], [0, 1, 2, 3])], timeout=1),
            receiver.metadata,
        ):
            with pytest.raises(LayoutError, match=refused):
                call()
        assert not receiver.posted  # nothing was posted


@needs_nixl
@pytest.mark.timeout(60)
def test_close_lets_go_of_readers_peers_memory_and_tensors(monkeypatch):
    """An agent keeps what it registered alive until it closes (NIXL reads that memory); closing
    (here by leaving ``with``) closes its readers, drops its peers from NIXL and deregisters."""
    sender = Agent("closing-sender")
    remote = caches_for("KBNHC", "KBHNC", SIZES, 4, 8, seed=2)
    remote_table = sender.register(remote, "KBNHC")
    alive = [weakref.ref(t) for t in remote.values()]
    del remote
    gc.collect()
    assert all(ref() is not None for ref in alive), "registered tensors were freed while registered"
    with Agent("closing-receiver") as receiver:
        local_table = receiver.register(caches_for("KBNHC", "KBNHC", SIZES, 16, 4, seed=3), "KBNHC")
        peer = receiver.add_peer(sender.metadata())
        reader = receiver.reader(plan_transfer(local_table, remote_table), peer)
        assert receiver.nixl.check_remote_metadata(peer)
        assert nixl_accepts(receiver, MINE, extent_rows(local_table))
        removed = Spy(monkeypatch, receiver.nixl, "remove_remote_agent")
        deregistered = Spy(monkeypatch, receiver.nixl, "deregister_memory")
    assert receiver.closed
    with pytest.raises(TransferError, match=f"reader towards {peer!r} is closed"):
        reader.read([0], [0, 1, 2, 3])
    with pytest.raises(TransferError, match="is closed"):
        reader.read_batch([([0], [0, 1, 2, 3])])
    with pytest.raises(TransferError, match="is closed"):
        reader.read_layers([([0], [0, 1, 2, 3])], timeout=1)
    assert [call[0] for call in removed.calls] == [peer] and len(deregistered.calls) == 1
    assert ended(receiver), "the NIXL agent (its worker and threads) outlived close"
    sender.close()
    gc.collect()
    assert all(ref() is None for ref in alive), "a closed agent still holds the tensors it registered"


def os_threads():
    return len(os.listdir("/proc/self/task"))


@needs_nixl
def test_close_ends_the_nixl_agent_while_its_caller_keeps_a_released_transfer():
    """A connector that keeps a transfer it released (a list of the step's transfers, a
    local still in scope) must not keep the NIXL agent alive past ``close``: its UCX worker
    threads and connections end with it. A released transfer holds no NIXL handle."""
    before = os_threads()
    sender, receiver = Agent("kept-transfer-sender"), Agent("kept-transfer-receiver")
    remote_table = sender.register(caches_for("KBNHC", "KBHNC", SIZES, 4, 8, seed=2), "KBNHC")
    local_table = receiver.register(caches_for("KBNHC", "KBNHC", SIZES, 16, 4, seed=3), "KBNHC")
    reader = receiver.reader(plan_transfer(local_table, remote_table), receiver.add_peer(sender.metadata()))
    transfer = reader.read([0], [0, 1, 2, 3])
    transfer.wait(timeout=20)
    transfer.release()
    assert transfer.handle is None
    assert os_threads() > before
    sender.close()
    receiver.close()
    gc.collect()
    assert os_threads() == before, "a released transfer kept a closed agent's NIXL threads alive"
    assert transfer.released and transfer.poll()  # what it says of itself stays true


def registered_plan(sender, receiver):
    """Caches of 4-token blocks registered with ``sender``, of 16 with ``receiver``: their plan."""
    remote_table = sender.register(caches_for("KBNHC", "KBHNC", SIZES, 4, 8, seed=4), "KBNHC")
    local_table = receiver.register(caches_for("KBNHC", "KBNHC", SIZES, 16, 4, seed=5), "KBNHC")
    return plan_transfer(local_table, remote_table)


@needs_nixl
@pytest.mark.timeout(60)
def test_peers_are_removed_and_the_same_metadata_again_keeps_them(monkeypatch):
    with Agent("peer-sender") as sender, Agent("peer-receiver") as receiver:
        plan = registered_plan(sender, receiver)
        removed = Spy(monkeypatch, receiver.nixl, "remove_remote_agent")
        receiver.remove_peer("nobody")  # a peer never added: nothing to do
        peer = receiver.add_peer(sender.metadata())
        assert peer == "peer-sender"
        assert receiver.add_peer(bytearray(sender.metadata())) == peer  # the same metadata again
        assert removed.calls == [], "loading the same metadata again dropped the peer"
        sender.register(caches_for("KBNHC", "KBNHC", SIZES, 4, 2, seed=6), "KBNHC")
        assert receiver.add_peer(sender.metadata()) == peer  # new metadata: loaded afresh
        assert removed.calls == [(peer,)]
        transfer = receiver.reader(plan, peer).read([1], [0, 1, 2, 3])
        transfer.wait(timeout=20)
        with pytest.raises(TransferError, match="'peer-sender' has 1 transfer\\(s\\) posted and not released"):
            receiver.remove_peer(peer)  # it landed, but its handle still holds the peer's keys
        transfer.release()
        receiver.remove_peer(peer)
        assert not receiver.nixl.check_remote_metadata(peer)
        with pytest.raises(TransferError, match="has no peer 'peer-sender'"):
            receiver.reader(plan, peer)
        receiver.remove_peer(peer)  # twice: nothing left to do
        assert removed.calls == [(peer,), (peer,)]


@needs_nixl
@pytest.mark.timeout(60)
def test_a_notification_that_is_no_bytes_and_a_post_to_no_peer_are_refused_before_nixl_sees_them(monkeypatch):
    with Agent("notify-sender") as sender, Agent("notify-receiver") as receiver:
        reader = receiver.reader(registered_plan(sender, receiver), receiver.add_peer(sender.metadata()))
        made = Spy(monkeypatch, receiver.nixl, "initialize_xfer")
        for bad in ("done", bytearray(b"done"), None, 7):
            said = f"READ from 'notify-sender': notify must be bytes, got {bad!r}"
            with pytest.raises(ArgumentError, match="^" + re.escape(said)):
                reader.read([1], [0, 1, 2, 3], notify=bad)
            with pytest.raises(ArgumentError, match="notify must be bytes"):
                reader.read_batch([([1], [0, 1, 2, 3])], notify=bad)
        no_peer = pytest.raises(ArgumentError, match="a peer is named by the text add_peer returned, got None")
        with no_peer, receiver.posting(None):  # type: ignore[arg-type]
            pass
        assert made.calls == [] and not receiver.posted
        transfer = reader.read([1], [0, 1, 2, 3], notify=b"done")  # bytes: posted
        transfer.wait(timeout=20)
        transfer.release()
        assert len(made.calls) == 1 and made.calls[0][-1] == b"done"


@needs_nixl
@pytest.mark.timeout(60)
def test_new_metadata_of_a_peer_with_a_transfer_not_released_is_refused_before_nixl_loads_it(monkeypatch):
    """The peer's keys are in use: its new metadata is refused, and NIXL never holds the new
    registrations merged with the old ones (it did, while the refusal said the peer stayed)."""
    from kvhost.nixl.agent import _metadata_name

    with Agent("changing-sender") as sender, Agent("changing-receiver") as receiver:
        first = sender.register(caches_for("KBNHC", "KBHNC", SIZES, 4, 8, seed=4), "KBNHC")
        old = sender.metadata()
        second = sender.register(caches_for("KBNHC", "KBHNC", SIZES, 4, 8, seed=6), "KBNHC")
        new = sender.metadata()
        assert _metadata_name(old) == _metadata_name(new) == "changing-sender"
        assert _metadata_name(b"nixlSerDes|Agent" + (5).to_bytes(8, "little") + b"short") is None  # no "|" after
        assert _metadata_name(b"other" + old) is None
        assert _metadata_name(b"nixlSerDes|Agenz" + old[16:]) is None  # laid out alike, under another head
        for length, named in ((4096, True), (4097, False)):  # names up to 4 bytes a character of 1,024
            blob = b"nixlSerDes|Agent" + length.to_bytes(8, "little") + b"n" * length + b"|"
            assert (_metadata_name(blob) == "n" * length) is named
        assert _metadata_name(b"nixlSerDes|Agent" + (2).to_bytes(8, "little") + b"\xff\xfe|") is None  # not UTF-8
        peer = receiver.add_peer(old)
        loaded = Spy(monkeypatch, receiver.nixl, "add_remote_agent")
        refused = r"'changing-sender' has 1 transfer\(s\) posted and not released"
        with receiver.posting(peer):
            assert receiver.add_peer(old) == peer  # the same metadata again: nothing to refuse
            with pytest.raises(TransferError, match=refused):
                receiver.add_peer(new)
        assert loaded.calls == [(old,)], "NIXL loaded the new metadata under a post"
        assert nixl_accepts(receiver, peer, extent_rows(first))
        assert not nixl_accepts(receiver, peer, extent_rows(second)), "the new registrations were merged in"
        assert receiver.add_peer(new) == peer  # nothing posted: loaded afresh
        assert nixl_accepts(receiver, peer, extent_rows(second))


@needs_nixl
@pytest.mark.timeout(60)
def test_an_agent_name_a_second_peer_claims_is_refused_and_the_first_kept():
    """Peers choose their agents' names: a second sender naming its agent as the first did
    would have the receiver read its memory where it meant the first's. NIXL refuses the
    second's connection info under a name it knows, and the first's stays as it was."""
    with Agent("twin") as first, Agent("twin") as second, Agent("twins-receiver") as receiver:
        first_table = first.register(caches_for("KBNHC", "KBHNC", SIZES, 4, 8, seed=7), "KBNHC")
        second_table = second.register(caches_for("KBNHC", "KBHNC", SIZES, 4, 8, seed=8), "KBNHC")
        local_table = receiver.register(caches_for("KBNHC", "KBNHC", SIZES, 16, 4, seed=9), "KBNHC")
        assert receiver.add_peer(first.metadata()) == "twin"
        with pytest.raises(ProtocolError, match=r"rejected by NIXL: NIXL_ERR_NOT_ALLOWED"):
            receiver.add_peer(second.metadata())
        assert nixl_accepts(receiver, "twin", extent_rows(first_table)), "the first peer's memory is gone"
        assert not nixl_accepts(receiver, "twin", extent_rows(second_table)), "the second peer's memory was loaded"
        transfer = receiver.reader(plan_transfer(local_table, first_table), "twin").read([1], [0, 1, 2, 3])
        transfer.wait(timeout=20)
        transfer.release()
        receiver.remove_peer("twin")
        assert receiver.add_peer(second.metadata()) == "twin"  # once let go, the name is free


@needs_nixl
@pytest.mark.timeout(60)
def test_a_peer_agent_name_that_is_not_plain_text_or_is_nixls_local_name_is_refused_and_let_go(monkeypatch):
    """A peer names its agent in its metadata, and the name then names it in every NIXL
    call and message. Bytes that are not UTF-8 (two such names would read as one), control
    characters, a name longer than MAX_PEER_NAME and NIXL's name for the local agent (read
    as our own memory wherever a transfer's side is named) are refused as ProtocolErrors,
    and NIXL lets go of what it loaded; a plain name of MAX_PEER_NAME is a peer."""
    longest, longer = "n" * MAX_PEER_NAME, "n" * (MAX_PEER_NAME + 1)
    names = ["peer-name-xyzw", "line\nbreak", MINE, longest, longer]
    with Agent("names-receiver") as receiver, contextlib.ExitStack() as stack:
        peers = {name: stack.enter_context(Agent(name)) for name in names}
        removed = Spy(monkeypatch, receiver.nixl, "remove_remote_agent")
        garbled = peers["peer-name-xyzw"].metadata().replace(b"peer-name-xyzw", b"peer-name-xy\xff\xfe")
        refusals = [
            (garbled, r"peer agent name b'peer-name-xy\\xff\\xfe' is not UTF-8 text", b"peer-name-xy\xff\xfe"),
            (peers["line\nbreak"].metadata(), r"peer agent name: expected printable text, got 'line\\nbreak'", None),
            (peers[MINE].metadata(), r"peer agent name 'NIXL_INIT_AGENT' is NIXL's name for the local agent", None),
            (peers[longer].metadata(), rf"peer agent name: expected a string of 1 to {MAX_PEER_NAME} characters", None),
        ]
        for metadata, message, raw_name in refusals:
            removed.calls.clear()
            with pytest.raises(ProtocolError, match=message):
                receiver.add_peer(metadata)
            assert len(removed.calls) == 1 and not receiver._peers
            if raw_name is not None:
                assert removed.calls[0][0] == raw_name
            else:
                assert not receiver.nixl.check_remote_metadata(removed.calls[0][0].decode()), "NIXL kept the peer"
        assert receiver.add_peer(peers[longest].metadata()) == longest
        assert receiver.add_peer(peers["peer-name-xyzw"].metadata()) == "peer-name-xyzw"


def test_a_peer_agent_name_given_as_text_is_checked_as_text():
    """NIXL 1.5's binding gives a peer's name as bytes; one that gives text is read the same."""
    assert _peer_name("prefill-r0") == "prefill-r0" == _peer_name(b"prefill-r0")
    with pytest.raises(ProtocolError, match="peer agent name 'NIXL_INIT_AGENT' is NIXL's name for the local agent"):
        _peer_name("NIXL_INIT_AGENT")
    with pytest.raises(ProtocolError, match="peer agent name: expected a string of 1 to 1024 characters, got 7"):
        _peer_name(7)


@needs_nixl
@pytest.mark.timeout(60)
def test_memory_an_agent_registered_is_refused_again_before_nixl_is_asked(monkeypatch):
    """Registered again (the same caches, other names or views over them, a layer across two
    registrations), NIXL would hold overlapping registrations, its metadata growing with
    each: refused, naming the layer, with nothing changed. Memory that only touches what was
    registered, or lies apart from it, registers."""
    pair = torch.zeros(2, 2, 4, 4, 2, 8, dtype=torch.bfloat16)  # two KBNHC layers, one after the other
    with Agent("registers-once", progress_thread=False) as agent:
        caches = caches_for("KBNHC", "KBNHC", SIZES, 4, 4, seed=1)
        agent.register(caches, "KBNHC")
        agent.register({"first": pair[0]}, "KBNHC")
        agent.register({"second": pair[1]}, "KBNHC")  # where the first ends
        metadata, huge_pages = agent.metadata(), agent.huge_pages
        asked = Spy(monkeypatch, agent.nixl, "register_memory")
        for again, axes, layer in (
            (caches, "KBNHC", "'l0'"),
            (CacheSet(caches, "KBNHC"), None, "'l0'"),
            ({"other": caches["l1"]}, "KBNHC", "'other'"),
            ({"l0": caches["l0"][:, 2:]}, "KBNHC", "'l0'"),  # its last two blocks
            ({"across": pair.view(4, 4, 4, 2, 8)[1:3]}, "KBNHC", "'across'"),  # the first's V, the second's K
        ):
            refused = rf"^agent 'registers-once': layer {layer}\[0\] \(bytes 0x[0-9a-f]+ to 0x[0-9a-f]+\) overlaps "
            with pytest.raises(ArgumentError, match=refused + "memory it registered before"):
                agent.register(again, axes)
        assert asked.calls == [] and agent.metadata() == metadata and agent.huge_pages == huge_pages
        apart = agent.register(caches_for("KBNHC", "KBNHC", SIZES, 4, 4, seed=2), "KBNHC")
        assert len(asked.calls) == 1 and len(agent.metadata()) > len(metadata)
        assert nixl_accepts(agent, MINE, extent_rows(apart))
    with Agent("registers-one-span", progress_thread=False) as agent:  # the span met is its first
        agent.register({"only": pair[0]}, "KBNHC")
        with pytest.raises(ArgumentError, match="layer 'again'"):
            agent.register({"again": pair[0]}, "KBNHC")


@needs_nixl
def test_nixl_refusing_an_agent_or_its_memory_is_a_kvhost_error(monkeypatch):
    from kvhost.nixl.agent import load_nixl

    def refuse(**config):
        raise RuntimeError("NIXL says no")

    with monkeypatch.context() as patched:
        patched.setattr(load_nixl(), "nixl_agent_config", refuse)
        with pytest.raises(NixlUnavailableError, match="could not start NIXL agent 'refused': RuntimeError: NIXL says"):
            Agent("refused")
    refused = "agent 'no-transport': registering 2 memory spans failed: NIXL_ERR_NOT_FOUND"
    with Agent("no-transport", backends=()) as bare, pytest.raises(TransferError, match=refused):
        bare.register(caches_for("KBNHC", "KBNHC", SIZES, 4, 4, seed=7), "KBNHC")


# --- readers --------------------------------------------------------------------------------


@needs_nixl
@pytest.mark.timeout(60)
def test_a_reader_checks_both_tables_and_posts_per_piece_without_a_bound():
    """A local table this agent never registered is refused when the reader is made. Without a
    bound (None) a batch posts one descriptor per piece, a bound of one byte merges nothing
    either, and both land what the default merged batch lands."""
    with Agent("reader-sender") as sender, Agent("reader-receiver") as receiver:
        remote = caches_for("KBNHC", "KBHNC", SIZES, 4, 12, seed=8, layers=3)
        remote_table = sender.register(remote, "KBNHC")
        peer = receiver.add_peer(sender.metadata())
        stranger = region_table(caches_for("KBNHC", "KBNHC", SIZES, 16, 6, seed=9, layers=3), "KBNHC")
        with pytest.raises(TransferError, match="the local table names memory this agent has not registered"):
            receiver.reader(plan_transfer(stranger, remote_table), peer)
        requests = [([4, 1], [0, 1, 2, 3, 4, 5, 6, 7]), ([2], [8, 9, 10])]
        landed = {}
        for bound in (None, 1, 1 << 20):
            local = caches_for("KBNHC", "KBNHC", SIZES, 16, 6, seed=10, layers=3)
            plan = plan_transfer(receiver.register(local, "KBNHC"), remote_table)
            reader = receiver.reader(plan, peer, max_descriptor_bytes=bound)
            assert (reader.local_domains is None) == (reader.remote_domains is None) == (bound is None)
            rows = reader.batch_descriptors(requests)
            transfer = reader.read_batch(requests)
            transfer.wait(timeout=20)
            assert transfer.descriptors == rows[0].shape[0] and transfer.nbytes == plan.bytes_for(11)
            transfer.release()
            if bound is None:
                per_piece = plan.descriptor_batch(requests)
                assert all(np.array_equal(a, b) for a, b in zip(rows, per_piece))
            elif bound == 1:
                assert rows[0].shape[0] == per_piece[0].shape[0]
            else:
                assert rows[0].shape[0] < per_piece[0].shape[0]
            landed[bound] = [raw(t).clone() for t in local.values()]
        for bound in (1, 1 << 20):
            assert all(torch.equal(a, b) for a, b in zip(landed[None], landed[bound])), bound


@needs_nixl
@pytest.mark.timeout(60)
def test_post_rows_names_each_sides_memory_and_refuses_an_unknown_peer(monkeypatch):
    with Agent("post-rows") as agent:
        table = agent.register(caches_for("KBNHC", "KBNHC", SIZES, 4, 4, seed=11), "KBNHC")
        rows = extent_rows(table)[:1]
        asked = Spy(monkeypatch, agent.nixl, "get_xfer_descs")
        with pytest.raises(TransferError, match="READ from 'nobody': creating the transfer failed"):
            post_rows(agent, "nobody", "READ", rows, rows + 0, ("DRAM", "VRAM"))
        assert [memory for _, memory in asked.calls] == ["DRAM", "VRAM"]
        assert asked.calls[0][0] is rows


# --- the memory one merged descriptor may span -----------------------------------------------


def register_whole(agent, tensor):
    return agent.nixl.register_memory([(tensor.data_ptr(), tensor.numel() * tensor.element_size(), 0, "")], "DRAM")


def register_halves(agent, tensor):
    """K and V halves as two regions: they touch, but no descriptor may span both."""
    return agent.nixl.register_memory(
        [(half.data_ptr(), half.numel() * half.element_size(), 0, "") for half in tensor], "DRAM"
    )


def register_blocks(agent, tensor):
    """Every block region on its own: no descriptor may span two blocks."""
    return agent.nixl.register_memory(
        [(block.data_ptr(), block.numel() * block.element_size(), 0, "") for half in tensor for block in half], "DRAM"
    )


def partition(labels):
    """Which streams share a label (a set of frozensets), and which may merge nothing (-1)."""
    groups = {}
    for stream, label in enumerate(labels.tolist()):
        if label != -1:
            groups.setdefault(label, set()).add(stream)
    return {frozenset(g) for g in groups.values()}, {s for s, label in enumerate(labels.tolist()) if label == -1}


class RefusingNixl:
    """NIXL's ``prep_xfer_dlist`` for memory registered block by block: every list refused."""

    def __init__(self):
        self.calls = 0

    def prep_xfer_dlist(self, owner, rows, memory):
        self.calls += 1
        raise RuntimeError("NIXL_ERR_NOT_FOUND")


def test_merge_domains_stops_probing_after_a_bounded_number_of_refusals():
    """Each refused probe costs NIXL an error line: 100 layers registered block by block are
    given up on after MAX_REFUSED_PROBES refusals, every stream left to merge nothing."""
    from kvhost.nixl.agent import MAX_REFUSED_PROBES

    table = region_table(caches_for("KBNHC", "KBNHC", SIZES, 4, 2, seed=12, layers=100), "KBNHC")
    nixl = RefusingNixl()
    assert (merge_domains(nixl, MINE, table) == -1).all() and len(table.streams) == 200
    assert nixl.calls == MAX_REFUSED_PROBES == 64  # the first, of every cluster at once, among them
    probes = Probes(3)  # shared by calls: what one leaves, the next may spend, and no more
    assert (merge_domains(nixl, MINE, table, probes) == -1).all() and nixl.calls == 64 + 3
    assert (merge_domains(nixl, MINE, table, probes) == -1).all() and nixl.calls == 64 + 3 and probes.left == 0


@needs_nixl
@pytest.mark.timeout(60)
def test_merge_domains_groups_streams_by_the_region_that_holds_them(monkeypatch):
    """Five layers (a K and a V stream each, touching), laid out in memory in another order
    than the table's: two registered whole, two as K and V halves, one block by block. A
    layer registered whole is one domain; each half its own; blocks, none (-1). The table
    lists them out of address order, so that every stream is looked up where it lies."""
    tensors = sorted((torch.zeros(2, 3, 4, 2, 8, dtype=torch.bfloat16) for _ in range(5)), key=lambda t: t.data_ptr())
    whole_low, halves_a, halves_b, blocks, whole_high = tensors  # in address order
    in_table = {"a": halves_a, "blocks": blocks, "b": halves_b, "high": whole_high, "low": whole_low}
    table = region_table(in_table, "KBNHC")
    streams = {name: (2 * i, 2 * i + 1) for i, name in enumerate(in_table)}  # (K, V) of each layer
    with Agent("domains", progress_thread=False) as agent:
        regions = [register_whole(agent, whole_low), register_whole(agent, whole_high)]
        regions += [register_halves(agent, halves_a), register_halves(agent, halves_b), register_blocks(agent, blocks)]
        try:
            groups, unmergeable = partition(merge_domains(agent.nixl, MINE, table))
            assert groups == {
                frozenset(streams["low"]),
                frozenset(streams["high"]),
                *(frozenset([s]) for s in streams["a"] + streams["b"]),
            }
            assert unmergeable == set(streams["blocks"])
        finally:
            for region in regions:
                agent.nixl.deregister_memory(region)
        every_layer = agent.register(in_table, "KBNHC")  # each tensor whole: one NIXL call says so
        asked = Spy(monkeypatch, agent.nixl, "prep_xfer_dlist")
        groups, unmergeable = partition(merge_domains(agent.nixl, MINE, every_layer))
        assert groups == {frozenset(pair) for pair in streams.values()} and not unmergeable
        assert len(asked.calls) == 1
        extents = stream_extents(every_layer)
        assert asked.calls[0][2] == "DRAM" and asked.calls[0][1].shape == (5, 3)
        assert sorted(asked.calls[0][1][:, 0].tolist()) == sorted(extents[::2, 0].tolist())
        assert (asked.calls[0][1][:, 1] == 2 * extents[0, 1]).all()  # each layer's K and V together


# --- a Transfer's states --------------------------------------------------------------------


class ScriptedNixl:
    """The two calls a Transfer makes (post, then poll), answered in order from ``script``:
    a state, or an exception to raise."""

    def __init__(self, *script):
        self.script = list(script)
        self.calls = 0

    def _answer(self, handle):
        self.calls += 1
        answer = self.script.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    transfer = check_xfer_state = _answer


class Handle:
    def __init__(self, fails=False):
        self.released = 0
        self.fails = fails

    def release(self):
        self.released += 1
        if self.fails:
            raise RuntimeError("the peer is gone")


def posted(*script, handle=None):
    nixl = ScriptedNixl(*script)
    handle = handle or Handle()
    link = Link(SimpleNamespace(nixl=nixl, uncancelled=[], posted=set()), "prefill")  # type: ignore[arg-type]
    return Transfer.post(link, handle, 4096, "READ", descriptors=3), nixl, handle


def test_a_transfer_is_known_to_its_agent_before_nixl_posts_it():
    """An interrupt once NIXL has posted it (a KeyboardInterrupt lands as the call returns)
    leaves a transfer close still knows of."""
    agent = SimpleNamespace(uncancelled=[], posted=set())

    class Interrupted(ScriptedNixl):
        def transfer(self, handle):
            self.known = set(agent.posted)
            raise KeyboardInterrupt

    agent.nixl = nixl = Interrupted()
    with pytest.raises(KeyboardInterrupt):
        Transfer.post(Link(agent, "prefill"), Handle(), 4096, "READ", descriptors=1)  # type: ignore[arg-type]
    assert len(nixl.known) == 1 and agent.posted == nixl.known


def test_a_transfer_released_on_two_threads_at_once_is_released_once():
    """close on one thread, a worker's release on another: NIXL frees a handle released twice twice."""

    class SlowHandle(Handle):
        def release(self):
            time.sleep(0.1)  # both threads past the released check, but for the lock
            super().release()

    transfer, _, handle = posted("PROC", "DONE", handle=SlowHandle())
    threads = [threading.Thread(target=transfer.release) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert handle.released == 1 and transfer.released


def test_a_transfer_polled_while_another_thread_releases_it_asks_nixl_nothing():
    """A poll waits for a release under way (a close on another thread), then finds the
    transfer released: NIXL is never asked about a handle it has freed."""

    class SlowHandle(Handle):
        def release(self):
            time.sleep(0.2)
            super().release()

    transfer, nixl, handle = posted("PROC", "ERR", "PROC", handle=SlowHandle())
    releasing = threading.Thread(target=transfer.release)
    releasing.start()
    time.sleep(0.05)  # the release holds the transfer's lock
    with pytest.raises(TransferError, match="was released before it finished"):
        transfer.poll()
    releasing.join(10)
    assert nixl.calls == 2 and handle.released == 1  # the post and the release's question


def test_a_transfer_is_done_only_when_nixl_says_done():
    transfer, nixl, handle = posted("PROC", "PROC", "DONE")
    assert transfer.finished is None and transfer.descriptors == 3 and transfer.nbytes == 4096
    assert transfer.poll() is False
    assert transfer.finished is None and transfer.seconds >= 0
    assert transfer.poll() is True
    finished = transfer.finished
    assert finished is not None and transfer.seconds == finished - transfer.started
    time.sleep(0.01)
    assert transfer.seconds == finished - transfer.started  # a finished transfer's time stands still
    assert transfer.poll() is True and nixl.calls == 3  # asked no more once done
    assert "handle" not in repr(transfer)
    transfer.release()
    transfer.release()
    assert handle.released == 1


def test_a_transfer_done_when_posted_is_never_polled():
    transfer, nixl, _ = posted("DONE")
    assert transfer.finished is not None and transfer.poll() is True and nixl.calls == 1


@pytest.mark.parametrize("script", [("DONE",), ("PROC", "ERR")])
def test_a_transfer_of_a_request_posted_again_leaves_the_request_to_its_maker(script):
    """``owns_handle=False`` (a request made once and posted again, as the bench's spans):
    a transfer over is released and let go of, and NIXL's request is not freed."""
    handle, agent = Handle(), SimpleNamespace(nixl=ScriptedNixl(*script), uncancelled=[], posted=set())
    link = Link(agent, "prefill")  # type: ignore[arg-type]
    transfer = Transfer.post(link, handle, 4096, "READ", descriptors=1, owns_handle=False)
    with contextlib.suppress(TransferError):  # the one that fails says so
        transfer.poll()
    transfer.release()
    assert transfer.released and agent.posted == set() and handle.released == 0
    agent.nixl = ScriptedNixl(*script)
    kept = Transfer.post(link, handle, 4096, "READ", descriptors=1)  # the default: the transfer's own
    with contextlib.suppress(TransferError):
        kept.poll()
    kept.release()
    assert handle.released == 1


def test_an_agent_names_the_transfers_that_may_still_write():
    """``Agent.in_flight``: posted, not released, and neither landed nor failed."""
    agent = SimpleNamespace(uncancelled=[], posted=set())
    transfers = {}
    for last in ("PROC", "DONE", "ERR"):
        agent.nixl = ScriptedNixl("PROC", last)
        transfers[last] = Transfer.post(Link(agent, last), Handle(), 4096, "READ", descriptors=1)  # type: ignore[arg-type]
        with contextlib.suppress(TransferError):
            transfers[last].poll()
    assert agent.posted == set(transfers.values())
    assert Agent.in_flight(agent) == [transfers["PROC"]]  # type: ignore[arg-type]


def test_a_transfer_that_fails_to_post_is_released_where_over_and_kept_where_part_may_be_in_flight():
    """NIXL's UCX backend posts a transfer's pieces one by one and stops at the first that
    fails: unless NIXL says the transfer is over, what it posted may still write."""
    for script, message, freed in (
        (
            [RuntimeError("no route")],
            "^READ from 'prefill': posting the transfer failed: no route; what it had "
            "posted may still write into its local blocks: kept, not freed$",
            False,
        ),
        (
            [RuntimeError("NIXL_ERR_REMOTE_DISCONNECT")],
            "posting the transfer failed: NIXL_ERR_REMOTE_DISCONNECT$",
            True,
        ),
        ([RuntimeError("no route"), "ERR"], "posting the transfer failed: no route$", True),
        (["ERR"], "^READ from 'prefill' failed: transport state 'ERR'$", True),
        (["FAILED?", "PROC"], "^READ from 'prefill' failed: transport state 'FAILED\\?'$", False),
    ):
        handle, agent = Handle(), SimpleNamespace(nixl=ScriptedNixl(*script), uncancelled=[], posted=set())
        with pytest.raises(TransferError, match=message):
            Transfer.post(Link(agent, "prefill"), handle, 4096, "READ", descriptors=3)  # type: ignore[arg-type]
        assert handle.released == freed and len(agent.uncancelled) == len(agent.posted) == (not freed), script


def test_a_transfer_that_fails_while_polled_is_an_error():
    transfer, _, _ = posted("PROC", "ERR")
    with pytest.raises(TransferError, match="READ from 'prefill' failed: transport state 'ERR'"):
        transfer.poll()
    transfer, _, _ = posted("PROC", RuntimeError("connection reset"))
    with pytest.raises(TransferError, match="READ from 'prefill' failed: connection reset"):
        transfer.poll()


def test_a_transfer_released_once_it_failed_cannot_be_polled():
    transfer, nixl, handle = posted("PROC", "ERR")
    transfer.release()
    assert handle.released == 1 and transfer.released
    with pytest.raises(TransferError, match="was released before it finished"):
        transfer.poll()
    assert nixl.calls == 2


@pytest.mark.parametrize("state", ["PROC", RuntimeError("no such handle")], ids=["in progress", "unknown"])
def test_a_transfer_in_flight_is_kept_not_freed_and_its_agent_knows(state):
    """NIXL's release of a transfer in flight does not stop it (test_a_read_in_flight_...):
    its handle is never handed back while NIXL says it is in flight or cannot say. The
    caller hears it may still write, may try again, and the agent keeps the memory."""
    transfer, nixl, handle = posted("PROC", state)
    agent = transfer.link.agent
    with pytest.raises(
        TransferError, match=r"^READ from 'prefill' is still in flight and cannot be cancelled: it may still write"
    ):
        transfer.release()
    assert not transfer.released and agent.uncancelled == [transfer] and agent.posted == {transfer}
    assert nixl.calls == 2 and handle.released == 0
    nixl.script.append("PROC")
    with pytest.raises(TransferError, match="still in flight"):
        transfer.release()  # tried again, still named once
    assert agent.uncancelled == [transfer] and handle.released == 0
    nixl.script.append("DONE")
    transfer.release()
    assert transfer.released and transfer.finished is not None and handle.released == 1
    assert agent.uncancelled == [] and agent.posted == set()
    transfer.release()
    assert handle.released == 1 and nixl.calls == 4


@pytest.mark.parametrize(
    "state", ["ERR", "DONE", RuntimeError("NIXL_ERR_REMOTE_DISCONNECT")], ids=["failed", "done", "peer gone"]
)
def test_a_transfer_that_is_over_counts_as_released_when_nixl_keeps_its_handle(state):
    """Failed on the wire, done, or its peer gone: nothing more lands, whatever NIXL says of the handle."""
    transfer, _, handle = posted("PROC", state, handle=Handle(fails=True))
    transfer.release()
    assert transfer.released and transfer.link.agent.uncancelled == [] and handle.released == 1
    if state == "DONE":
        assert transfer.poll() is True  # landed, and known to have
    else:
        with pytest.raises(TransferError, match="was released before it finished"):
            transfer.poll()


def test_a_transfer_whose_peer_went_away_when_polled_is_released_without_asking_again():
    transfer, nixl, handle = posted("PROC", RuntimeError("nixlRemoteDisconnectError: NIXL_ERR_REMOTE_DISCONNECT"))
    with pytest.raises(TransferError, match="failed: nixlRemoteDisconnectError"):
        transfer.poll()
    transfer.release()
    assert transfer.released and handle.released == 1 and nixl.calls == 2


STILL_IN_FLIGHT = "READ from 'prefill' is still in flight and cannot be cancelled: it may still write"


@pytest.mark.parametrize(
    ("l1_script", "message", "timed_out"),
    [
        (["PROC"] * 100_000, f"READ from 'prefill' did not finish within 0.05 s; {STILL_IN_FLIGHT}", True),
        (["PROC", "ERR"], "READ from 'prefill' failed: transport state 'ERR'", False),
    ],
    ids=["stalls", "fails"],
)
def test_a_layer_that_does_not_land_is_named_with_its_place(l1_script, message, timed_out):
    """Layer by layer, the error says which layer did not land and where it stands (those
    before it did), keeping whether it was a deadline; nothing more is posted, all is
    released but a transfer still in flight, which the error names too."""
    landed, _, landed_handle = posted("DONE")
    stuck, _, stuck_handle = posted(*l1_script)
    transfers = {"l0": [landed], "l1": [stuck], "l2": []}
    asked, yielded = [], []

    def post(name):
        asked.append(name)
        return transfers[name]

    with pytest.raises(TransferError) as raised:
        for name in layer_by_layer(post, list(transfers), 0.05):
            yielded.append(name)
    assert str(raised.value).startswith(f"layer 'l1' (2 of 3): {message}")
    assert raised.value.timed_out is timed_out
    assert yielded == ["l0"] and asked == ["l0", "l1"]
    assert landed_handle.released == 1 and stuck_handle.released == stuck.released == (not timed_out)


def test_a_layer_loop_left_early_gives_the_layer_in_flight_its_deadline_then_releases_it():
    landed, _, _ = posted("DONE")
    late, nixl, late_handle = posted("PROC", "PROC", "PROC", "DONE")
    layers = layer_by_layer(lambda name: {"l0": [landed], "l1": [late]}[name], ["l0", "l1"], 5.0)
    assert next(layers) == "l0"
    layers.close()  # l1 lands meanwhile: released, nothing raised
    assert late.released and late_handle.released == 1 and nixl.calls == 4


def test_the_module_holds_an_agent_only_while_a_transfer_of_it_may_write():
    from kvhost.nixl.agent import _HOLDING

    transfer, _, _ = posted("PROC", "PROC", "DONE")
    agent = transfer.link.agent
    assert id(agent) in _HOLDING
    assert transfer.poll() is False and id(agent) in _HOLDING
    assert transfer.poll() is True and id(agent) not in _HOLDING  # landed, never released: nothing held
    assert agent.posted == {transfer}
    failed, _, _ = posted("PROC", "ERR")
    with pytest.raises(TransferError):
        failed.poll()
    assert id(failed.link.agent) not in _HOLDING
    first, nixl, _ = posted("PROC", "DONE")
    second = Transfer.post(first.link, Handle(), 4096, "READ", descriptors=1)  # answered PROC: in flight
    nixl.script.append("DONE")
    assert second.poll() is True and id(first.link.agent) in _HOLDING, "let go while the first may write"
    assert first.poll() is True and id(first.link.agent) not in _HOLDING


class LookedAt(set):
    """An agent's ``posted`` that counts the transfers looked at through it."""

    looked = 0

    def __iter__(self):
        for transfer in super().__iter__():
            self.looked += 1
            yield transfer


def test_a_transfer_that_ends_settles_its_agent_without_a_look_at_those_landed_before():
    """Transfers that landed and were never released stay posted until released: were each
    landing, failure or release to look at them, every one would cost as many as its
    callers left (3,000 unreleased reads took 3.3 s against 2.0 s released)."""
    from kvhost.nixl.agent import _HOLDING, _WRITING

    agent = SimpleNamespace(nixl=ScriptedNixl(*["DONE"] * 1000), uncancelled=[], posted=LookedAt())
    link = Link(agent, "prefill")  # type: ignore[arg-type]
    for _ in range(1000):
        Transfer.post(link, Handle(), 4096, "READ", descriptors=1)  # landed as posted, never released
    agent.nixl.script += ["PROC", "PROC", "PROC", "DONE", "ERR", "DONE"]  # three posted, then each asked once
    landing, failing, released = (Transfer.post(link, Handle(), 4096, "READ", descriptors=1) for _ in range(3))
    agent.posted.looked = 0
    assert landing.poll() is True and id(agent) in _HOLDING  # two still in flight
    with pytest.raises(TransferError, match="transport state 'ERR'"):
        failing.poll()
    assert id(agent) in _HOLDING
    released.release()  # landed when asked
    assert id(agent) not in _HOLDING and id(agent) not in _WRITING and agent.posted.looked == 0
    assert Agent.in_flight(agent) == [] and len(agent.posted) == 1002  # type: ignore[arg-type]


def test_an_agent_whose_only_transfer_lost_its_peer_is_let_go_without_a_release():
    """Its peer gone, nothing more lands: the module lets go of the agent as it does of one
    whose transfer landed, and NIXL saying something else when asked again changes nothing.
    Any other error says nothing of what is in flight: that agent stays held."""
    from kvhost.nixl.agent import _HOLDING

    gone = RuntimeError("nixlRemoteDisconnectError: NIXL_ERR_REMOTE_DISCONNECT")
    transfer, _, handle = posted("PROC", gone, RuntimeError("connection reset"))
    agent = transfer.link.agent
    with pytest.raises(TransferError, match="NIXL_ERR_REMOTE_DISCONNECT"):
        transfer.poll()
    assert id(agent) not in _HOLDING and transfer.failed and Agent.in_flight(agent) == []
    with pytest.raises(TransferError, match="connection reset"):
        transfer.poll()
    assert transfer.failed and Agent.in_flight(agent) == [] and id(agent) not in _HOLDING
    assert not transfer.released and handle.released == 0 and agent.posted == {transfer}
    unknown, _, _ = posted("PROC", RuntimeError("connection reset"))
    with pytest.raises(TransferError, match="connection reset"):
        unknown.poll()
    assert id(unknown.link.agent) in _HOLDING and Agent.in_flight(unknown.link.agent) == [unknown]


PINNED_AT_EXIT = r"""
import atexit, sys
from types import SimpleNamespace

def stand_in(name):  # freed, its file is closed and what was written to it flushed; pinned, never
    agent = SimpleNamespace(posted=set(), uncancelled=[], file=open(f"{sys.argv[1]}/{name}", "w"))
    agent.file.write(name)
    return agent

late = stand_in("late")
# Registered before the agent module's own hook, so run after it: a post while exiting.
atexit.register(lambda: hold(late, object()))
from kvhost.nixl.agent import _hold as hold
held, free = stand_in("held"), stand_in("free")
hold(held, object())
"""


def test_agents_that_may_be_written_into_are_never_freed_at_exit(tmp_path):
    """Interpreter shutdown would free every module's objects, an agent with a read in
    flight among them (and NIXL's teardown under the read corrupted the heap): those the
    module holds when it exits, or comes to hold while it does, are pinned; others go."""
    import subprocess
    import sys

    subprocess.run([sys.executable, "-c", PINNED_AT_EXIT, str(tmp_path)], timeout=120, check=True)
    assert {name: (tmp_path / name).read_text() for name in ("free", "held", "late")} == {
        "free": "free",
        "held": "",
        "late": "",
    }


def test_an_agent_knows_each_transfer_from_its_post_to_its_release():
    transfer, _, _ = posted("PROC", "DONE")
    agent = transfer.link.agent
    assert agent.posted == {transfer}
    transfer.release()
    assert agent.posted == set()
    stuck, _, _ = posted("PROC", "PROC")
    with pytest.raises(TransferError, match="still in flight"):
        stuck.release()
    assert stuck.link.agent.posted == {stuck} and stuck.link.agent.uncancelled == [stuck]
    link = Link(SimpleNamespace(nixl=ScriptedNixl("ERR"), uncancelled=[], posted=set()), "prefill")  # type: ignore[arg-type]
    with pytest.raises(TransferError, match="transport state 'ERR'"):
        Transfer.post(link, Handle(), 1, "READ", descriptors=1)  # refused when posted: released there
    assert link.agent.posted == set()
    failed_post, _, _ = posted("PROC")
    failed_post.link.agent.posted.clear()
    with pytest.raises(TransferError):
        Transfer.post(failed_post.link, Handle(), 1, "READ", descriptors=1)  # the script has run out: NIXL raises
    assert len(failed_post.link.agent.posted) == 1  # part of it may be in flight: kept


def test_post_all_gives_every_transfer_or_releases_those_posted():
    first, _, _ = posted("PROC")
    second, _, _ = posted("PROC")
    assert post_all([lambda: [first], lambda: [second]]) == [first, second]
    third, _, third_handle = posted("PROC", "DONE")

    def refused():
        raise TransferError("the second rank's post failed")

    with pytest.raises(TransferError, match=r"^the second rank's post failed$"):
        post_all([lambda: [third], refused])
    assert third.released and third_handle.released == 1
    assert not first.released and not second.released
    fourth, _, fourth_handle = posted("PROC", "PROC")
    with pytest.raises(TransferError, match=r"^the second rank's post failed") as raised:
        post_all([lambda: [fourth], refused])  # the error stays the caller's, and says what is left
    assert raised.value.__notes__ == [
        f"{STILL_IN_FLIGHT} into its local blocks, which must not be reused until it is released"
    ]
    assert not fourth.released and fourth_handle.released == 0

    def interrupted():
        raise KeyboardInterrupt

    fifth, _, _ = posted("PROC", "PROC")
    with pytest.raises(KeyboardInterrupt):
        post_all([lambda: [fifth], interrupted])


def test_release_all_releases_every_transfer_and_names_those_left():
    stuck, _, _ = posted("PROC", "PROC")
    free, _, free_handle = posted("PROC", "DONE")
    with pytest.raises(TransferError, match=f"^{STILL_IN_FLIGHT}") as raised:
        release_all([stuck, free])
    assert free.released and free_handle.released == 1 and not stuck.released
    assert str(raised.value).count("still in flight") == 1


@needs_nixl
def test_an_agent_keeps_memory_a_transfer_may_still_write_registered():
    agent = Agent("uncancelled", progress_thread=False)
    caches = caches_for("KBNHC", "KBNHC", SIZES, 4, 4, seed=1)
    table = agent.register(caches, "KBNHC")
    alive = [weakref.ref(t) for t in caches.values()]
    del caches
    handle = Handle()
    stuck = Transfer(Link(agent, "prefill"), handle, 4096, "READ", 3)  # NIXL cannot tell the state of this handle
    _hold(agent, stuck)
    with pytest.raises(TransferError, match=r"1 transfer\(s\) from \['prefill'\] still in flight may write"):
        agent.close()
    assert handle.released == 0 and agent.uncancelled == [stuck], "close asks each, and frees none in flight"
    with pytest.raises(ValueError, match=r"^the body's own") as raised, agent:
        raise ValueError("the body's own")
    with pytest.raises(TransferError, match="still in flight may write"), agent:
        pass  # no error of its own: close's is raised
    assert "1 transfer(s) from ['prefill'] still in flight may write" in raised.value.__notes__[0]
    gc.collect()
    assert all(ref() is not None for ref in alive) and nixl_accepts(agent, MINE, extent_rows(table))
    stuck.finished = time.perf_counter()  # a poll found it landed
    agent.close()  # the transfer lets go now: so does the agent
    assert handle.released == 1 and agent.uncancelled == [] and ended(agent)
    gc.collect()
    assert all(ref() is None for ref in alive)


@needs_nixl
def test_a_peer_is_not_removed_under_a_post_towards_it():
    with Agent("posting-peer", progress_thread=False) as agent:
        with agent.posting("prefill"), pytest.raises(TransferError, match=r"'prefill' has 1 transfer\(s\) posted"):
            agent.remove_peer("prefill")
        with agent.posting("prefill"):
            with agent.posting("prefill"):  # two threads' posts: the first to end leaves the other counted
                pass
            with pytest.raises(TransferError, match=r"'prefill' has 1 transfer\(s\) posted"):
                agent.remove_peer("prefill")
        with agent.posting("decode"):
            agent.remove_peer("prefill")  # a post towards another peer: nothing refused (nor anything to remove)
        assert agent._posts_to == {}, "a count kept for every peer ever posted to"


def test_a_wait_polls_at_its_interval_until_its_deadline():
    transfer, nixl, _ = posted(*["PROC"] * 100)
    started = time.monotonic()
    with pytest.raises(TransferError, match=r"READ from 'prefill' did not finish within 0\.3 s") as raised:
        transfer.wait(timeout=0.3, interval=0.05)
    took = time.monotonic() - started
    assert raised.value.timed_out and 0.3 <= took < 5.0
    # a poll at the start and one after each pause of at least 0.05 s: at most 8 (a wait
    # that did not pause would run through the script's 100 answers at once)
    assert 2 <= nixl.calls <= 8, f"{nixl.calls} polls in {took:.2f} s at 0.05 s apart"
    transfer, _, _ = posted("PROC", "DONE")
    transfer.wait(timeout=5, interval=1)  # at most a second between polls
    assert transfer.finished is not None  # (intervals out of range: test_peer_limits.py)


CLOSED_UNDER_A_PEERS_READ = """
import gc, os, sys, torch
from kvhost.nixl import Agent, TransferError, plan_transfer

sender, reader = Agent("closes-under-a-read"), Agent("reads-from-a-closing-one")
theirs = {f"l{i}": torch.full((2, 128, 256, 8, 128), i + 7, dtype=torch.bfloat16) for i in range(2)}
remote = sender.register(theirs, "KBNHC")
mine = {f"l{i}": torch.zeros((2, 128, 256, 8, 128), dtype=torch.bfloat16) for i in range(2)}
local = reader.register(mine, "KBNHC")
read = reader.reader(plan_transfer(local, remote), reader.add_peer(sender.metadata())).read(range(128), range(128))
threads = len(os.listdir("/proc/self/task"))
sender.close()
print("threads", threads, "->", len(os.listdir("/proc/self/task")), flush=True)
del theirs
gc.collect()
reused = [torch.full((64 << 20,), 3, dtype=torch.int64) for _ in range(2)]  # where the sender's tensors were
try:
    read.wait(30)
    print("landed", flush=True)
except TransferError as err:
    print("failed", "NIXL_ERR_REMOTE_DISCONNECT" in str(err), flush=True)
read.release()
reader.close()
print("closed", flush=True)
"""


@needs_nixl
@pytest.mark.timeout(120)
def test_an_agent_closed_while_a_peer_reads_its_memory_ends_nixl_before_the_tensors_go():
    """Deregistering does not stop a peer's read under way: over TCP it read on from the
    tensors close let go of, and the process crashed (SIGSEGV). close now ends the NIXL agent
    (its UCX worker and threads) first, and the peer's read fails."""
    import subprocess
    import sys

    env = dict(os.environ, UCX_TLS="tcp", UCX_LOG_LEVEL="error", NIXL_LOG_LEVEL="ERROR")
    run = subprocess.run(
        [sys.executable, "-c", CLOSED_UNDER_A_PEERS_READ], capture_output=True, text=True, env=env, timeout=100
    )
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    lines = run.stdout.split("\n")
    before, after = (int(n) for n in lines[0].split()[1::2])
    assert after < before, "the closed agent's threads are still running"
    assert lines[1] in ("failed True", "landed") and lines[2] == "closed", run.stdout


@needs_nixl
def test_a_peer_plan_or_request_of_the_wrong_kind_is_refused_naming_it():
    """They raised TypeError and AttributeError (an unhashable list for a peer, None for a
    plan, a request of one list)."""
    from kvhost.errors import RequestError
    from kvhost.nixl import RankReader

    with Agent("wrong-kinds-sender") as sender, Agent("wrong-kinds") as receiver:
        remote = sender.register(caches_for("KBNHC", "KBHNC", SIZES, 4, 8, seed=2), "KBNHC")
        local = receiver.register(caches_for("KBNHC", "KBNHC", SIZES, 16, 4, seed=3), "KBNHC")
        peer = receiver.add_peer(sender.metadata())
        for wrong in (["x"], None, b"x"):
            with pytest.raises(ArgumentError, match="a peer is named by the text add_peer returned"):
                receiver.remove_peer(wrong)
            with pytest.raises(ArgumentError, match="a peer is named by the text add_peer returned"):
                receiver.reader(plan_transfer(local, remote), wrong)
        with pytest.raises(ArgumentError, match=r"plan must be a TransferPlan \(plan_transfer's\), got None"):
            receiver.reader(None, peer)
        reader = receiver.reader(plan_transfer(local, remote), peer)
        with pytest.raises(RequestError, match=r"request 0 of 1: expected \(local ids, remote ids\), got \(\[0\],\)"):
            reader.read_batch([([0],)])
        reader.read_batch([[[0], [0, 1, 2, 3]]]).wait(10)  # a pair as a list is a pair
        with pytest.raises(ArgumentError, match=r"a RankReader takes a RankPlan \(plan_ranks'\) and a mapping"):
            RankReader(receiver, None, {})
