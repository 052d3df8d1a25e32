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
