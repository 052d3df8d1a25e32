"""A few receive and copy calls through the numba kernels, every byte checked: small enough for valgrind.

``ci/memcheck.sh --valgrind`` runs this under valgrind memcheck, which reports any read or
write of memory that was freed (or never allocated) whatever its size; the glibc settings
of the plain ``ci/memcheck.sh`` only make large chunks fault. Run it once without valgrind
first: numba then loads its cached kernels instead of compiling them under valgrind.

Covers both kernel variants (calling thread: jobs under 1 MiB; all threads: larger jobs),
pieces smaller than a region (r > 1), pieces spanning g regions, and copies of runs and of
scattered blocks between layouts.
"""

from __future__ import annotations

import time

import torch
from kvhost_cpu.kernels import SERIAL_BYTES  # numba: these are the kernels under test

import kvhost
from kvhost.caches import CacheSet
from kvhost.testing import ReceiveCase, fill_random, make_cache, raw, read_tokens

# (name, axes, physical, sizes, remote order, remote block size, request ids)
RECEIVES = [
    ("r4 HND16 -> NHD64, calling thread", "KBNHC", "KBNHC", dict(K=2, B=6, N=64, H=2, C=64), "HNC", 16, [4, 1]),
    ("g4 HND64 -> NHD16, calling thread", "KBNHC", "KBNHC", dict(K=2, B=10, N=16, H=2, C=64), "HNC", 64, [8, 2, 5, 6]),
    (
        "g2 KNHC16 -> KHNC8 (K inside the block), calling thread",
        "BKNHC",
        "BKHNC",
        dict(K=2, B=6, N=8, H=4, C=32),
        "KNHC",
        16,
        [3, 1],
    ),
    # Over SERIAL_BYTES: the parallel kernel, one scratch row per thread.
    (
        "g8 HND512 -> NHD64, all threads",
        "KBNHC",
        "KBNHC",
        dict(K=2, B=10, N=64, H=8, C=128),
        "HNC",
        512,
        list(range(1, 9)),
    ),
]
SMALL, LARGE = dict(K=2, B=8, N=16, H=4, C=32), dict(K=2, B=8, N=64, H=8, C=128)
# (name, src axes and physical order, dst axes and physical order, sizes, src ids, dst ids)
COPIES = [
    (
        "HND -> NHD, runs and scattered, calling thread",
        ("KBNHC", "KBHNC"),
        ("KBNHC", "KBNHC"),
        SMALL,
        [0, 1, 2, 7, 4],
        [3, 4, 5, 0, 1],
    ),
    ("NHD -> NHD, one run, calling thread", ("KBNHC", "KBNHC"), ("KBNHC", "KBNHC"), SMALL, [2, 3, 4], [5, 6, 7]),
    (
        "HND -> NHD, runs and scattered, all threads",
        ("KBNHC", "KBHNC"),
        ("KBNHC", "KBNHC"),
        LARGE,
        [0, 1, 2, 7, 4],
        [3, 4, 5, 0, 1],
    ),
]


def receive_case(
    name: str, axes: str, physical: str, sizes: dict[str, int], order: str, remote: int, ids: list[int]
) -> str:
    caches = {f"l{i}": make_cache(axes, physical, sizes, torch.bfloat16) for i in range(2)}
    case = ReceiveCase(caches, axes, seed=len(ids))
    case.send("req", ids, order, remote)
    stats = kvhost.receive(caches, {"req": ids}, axes=axes, remote_order=order, remote_block_size=remote, backend="cpu")
    case.check()
    path = "all threads" if stats.bytes_moved >= SERIAL_BYTES else "calling thread"
    return f"{stats.bytes_moved} bytes ({path})"


def copy_case(
    name: str, src: tuple[str, str], dst: tuple[str, str], sizes: dict[str, int], src_ids: list[int], dst_ids: list[int]
) -> str:
    source = {f"l{i}": fill_random(make_cache(*src, sizes, torch.bfloat16), i) for i in range(2)}
    dest = {f"l{i}": fill_random(make_cache(*dst, sizes, torch.bfloat16), 10 + i) for i in range(2)}
    before = [raw(m.tensor).clone() for m in CacheSet(dest, dst[0]).members]
    result = kvhost.copy_blocks(source, dest, src_ids, dst_ids, axes=src[0], dst_axes=dst[0], backend="cpu")
    result.wait()
    for s, d, saved in zip(CacheSet(source, src[0]).members, CacheSet(dest, dst[0]).members, before):
        for si, di in zip(src_ids, dst_ids):
            assert torch.equal(read_tokens(d.tensor, d.layout, [di]), read_tokens(s.tensor, s.layout, [si])), name
        b = d.layout.axes.index("B")
        for block in set(range(d.layout.num_blocks)) - set(dst_ids):
            assert torch.equal(raw(d.tensor).select(b, block), saved.select(b, block)), f"{name}: block {block}"
    path = "all threads" if result.bytes_moved >= SERIAL_BYTES else "calling thread"
    return f"{result.bytes_moved} bytes ({path})"


def main() -> None:
    start = time.perf_counter()
    for name, *args in RECEIVES:
        print(f"receive {name}: {receive_case(name, *args)} OK", flush=True)
    for name, *copy_args in COPIES:
        print(f"copy {name}: {copy_case(name, *copy_args)} OK", flush=True)
    print(f"memcheck_kernels: every byte checked ({time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()
