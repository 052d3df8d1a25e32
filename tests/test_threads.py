"""KVHost is safe to call from two threads on disjoint blocks."""

from __future__ import annotations

import threading

import kvhost
from kvhost.testing import ReceiveCase, make_cache


def test_two_threads_receive_disjoint_blocks(target):
    sizes = dict(K=2, B=64, N=16, H=4, C=32)
    caches = {f"l{i}": make_cache("KBNHC", "KBNHC", sizes, device=target.device) for i in range(4)}
    host = kvhost.KVHost(caches, axes="KBNHC", backend=target.backend)
    case = ReceiveCase(caches, "KBNHC", seed=3)
    halves = {"even": list(range(0, 64, 2)), "odd": list(range(1, 64, 2))}
    for thread_name, ids in halves.items():
        for i in range(0, len(ids), 4):
            case.send(f"{thread_name}{i}", ids[i : i + 4], "HNC", 4)
    errors: list[BaseException] = []
    barrier = threading.Barrier(2)

    def work(thread_name: str) -> None:
        try:
            barrier.wait()
            for i in range(0, 32, 4):
                host.receive(
                    {f"{thread_name}{i}": halves[thread_name][i : i + 4]}, remote_order="HNC", remote_block_size=4
                )
        except BaseException as err:  # surfaced below
            errors.append(err)

    threads = [threading.Thread(target=work, args=(name,)) for name in halves]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    case.check()


def test_a_call_on_registered_caches_holds_the_backends_exclusive_lock_throughout():
    """Where a device cannot read a tensor's facts while another thread updates it (XLA),
    the check of the caches and the backend's work run under its lock, for every call."""
    import contextlib

    from kvhost.torch_backend import TorchBackend

    events: list[str] = []

    class Recording(TorchBackend):
        @contextlib.contextmanager
        def exclusive(self):  # type: ignore[no-untyped-def, override]
            events.append("enter")
            yield
            events.append("exit")

        def receive(self, job):  # type: ignore[no-untyped-def]
            events.append("receive")
            super().receive(job)

        def copy(self, job):  # type: ignore[no-untyped-def]
            events.append("copy")
            return super().copy(job)

    sizes = dict(K=2, B=8, N=8, H=2, C=4)
    caches = {"l0": make_cache("KBNHC", "KBNHC", sizes)}
    host_buffer = {"l0": make_cache("KBNHC", "KBNHC", sizes)}
    host = kvhost.KVHost(caches, axes="KBNHC", backend=Recording())
    checks = []
    original = host.caches.check_current

    def check_current() -> None:
        checks.append(events[-1])
        original()

    host.caches.check_current = check_current  # type: ignore[method-assign]
    host.receive({"r": [1, 2]}, remote_order="HNC", remote_block_size=4)
    host.copy_to(host_buffer, [1, 2], [0, 1]).wait()
    host.copy_from(host_buffer, [0, 1], [3, 4]).wait()
    assert events == ["enter", "receive", "exit", "enter", "copy", "exit", "enter", "copy", "exit"]
    assert checks == ["enter", "enter", "enter"]  # each check inside the lock, before the work
