"""What a same-host transfer can reach: the kernel's cross-process copy against memcpy.

UCX moves host memory between two processes on one machine with CMA
(``process_vm_readv``): one copy, done by the kernel, which pins the other process's pages
as it goes. This times that copy alone, with no UCX or NIXL in the way, side by side with
a memcpy of the same bytes in this process, interleaved rounds, medians:

    python experiments/cma_floor.py [--mib 122] [--rounds 15] [--huge]

- ``memcpy``: ``np.copyto`` between two buffers of this process;
- ``cma/N``: ``process_vm_readv`` of a child's buffer into ours, iovecs of N bytes, up to
  ``--per-call`` per system call (default 1024, the kernel's ``UIO_MAXIOV``; 1 is what UCX
  does, one call per descriptor), the iovec arrays built before timing.

``--sender-huge`` and ``--reader-huge`` ask for transparent huge pages on that side's
buffers, where the kernel leaves that to the program (``[madvise]`` in
/sys/kernel/mm/transparent_hugepage/enabled): ``hint`` (``MADV_HUGEPAGE`` before the
pages are first touched) or ``collapse`` (``MADV_COLLAPSE`` of pages already there, Linux
6.1 and later).
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import multiprocessing as mp
import random
import statistics
import time
from collections.abc import Callable

import numpy as np

LIBC = ctypes.CDLL(None, use_errno=True)
MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25
UIO_MAXIOV = 1024


class IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("length", ctypes.c_size_t)]


LIBC.process_vm_readv.restype = ctypes.c_ssize_t
LIBC.process_vm_readv.argtypes = [
    ctypes.c_int,
    ctypes.POINTER(IoVec),
    ctypes.c_ulong,
    ctypes.POINTER(IoVec),
    ctypes.c_ulong,
    ctypes.c_ulong,
]
LIBC.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def buffer(nbytes: int, huge: str) -> tuple[mmap.mmap, np.ndarray]:
    """A buffer with every page touched; ``huge``: "" (the kernel's default), "hint"
    (MADV_HUGEPAGE before the first touch) or "collapse" (MADV_COLLAPSE after it)."""
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    array = np.frombuffer(region, dtype=np.uint8)
    if huge == "hint":
        advise(array, MADV_HUGEPAGE)
    array[:] = np.arange(nbytes, dtype=np.uint64).astype(np.uint8)  # touch every page
    if huge == "collapse":
        start = time.perf_counter()
        advise(array, MADV_COLLAPSE)
        print(f"MADV_COLLAPSE of {nbytes >> 20} MiB: {(time.perf_counter() - start) * 1e3:.1f} ms")
    return region, array


def advise(array: np.ndarray, advice: int) -> None:
    if LIBC.madvise(array.ctypes.data, array.nbytes, advice) != 0:
        raise OSError(ctypes.get_errno(), f"madvise({advice})")


def sender(nbytes: int, huge: str, conn) -> None:
    _region, array = buffer(nbytes, huge)
    conn.send(array.ctypes.data)
    conn.recv()  # hold the buffer until the reader is done


def cma_reader(pid: int, remote: int, local: np.ndarray, piece: int, per_call: int = UIO_MAXIOV) -> Callable[[], None]:
    """A read of ``remote`` into ``local`` in iovecs of ``piece`` bytes, ``per_call`` of them
    per system call, the iovec arrays built beforehand (as UCX holds its descriptors)."""
    nbytes = local.nbytes
    offsets = range(0, nbytes, piece)
    calls = []
    for first in range(0, len(offsets), per_call):
        chunk = offsets[first : first + per_call]
        ours = (IoVec * len(chunk))()
        theirs = (IoVec * len(chunk))()
        for i, offset in enumerate(chunk):
            length = min(piece, nbytes - offset)
            ours[i] = IoVec(local.ctypes.data + offset, length)
            theirs[i] = IoVec(remote + offset, length)
        calls.append((ours, theirs, len(chunk), sum(v.length for v in ours)))

    def read() -> None:
        for ours, theirs, count, want in calls:
            got = LIBC.process_vm_readv(pid, ours, count, theirs, count, 0)
            if got != want:
                raise OSError(ctypes.get_errno(), f"process_vm_readv read {got} of {want} bytes")

    return read


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=122)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--pieces", default="16384,65536,1048576,0", help="iovec sizes, bytes (0: the whole buffer)")
    parser.add_argument("--per-call", type=int, default=UIO_MAXIOV, help="iovecs per process_vm_readv (at most 1024)")
    parser.add_argument("--sender-huge", choices=("", "hint", "collapse"), default="")
    parser.add_argument("--reader-huge", choices=("", "hint", "collapse"), default="")
    args = parser.parse_args()
    nbytes = args.mib << 20
    ours, theirs = mp.Pipe()
    child = mp.Process(target=sender, args=(nbytes, args.sender_huge, theirs))
    child.start()
    remote = ours.recv()
    _a, source = buffer(nbytes, args.reader_huge)
    _b, local = buffer(nbytes, args.reader_huge)
    expected = np.arange(nbytes, dtype=np.uint64).astype(np.uint8)
    cma_reader(child.pid, remote, local, 1 << 20)()
    assert np.array_equal(local, expected), "process_vm_readv read other bytes"
    pieces = [int(p) or nbytes for p in args.pieces.split(",")]
    methods = {"memcpy": lambda: np.copyto(local, source)}
    for piece in pieces:
        name = f"cma/{piece >> 10}KiB" if piece < nbytes else "cma/whole"
        methods[name] = cma_reader(child.pid, remote, local, piece, args.per_call)
    times: dict[str, list[float]] = {name: [] for name in methods}
    for _ in range(args.rounds):
        order = list(methods)
        random.shuffle(order)
        for name in order:
            start = time.perf_counter()
            methods[name]()
            times[name].append(time.perf_counter() - start)
    ours.send("done")
    child.join()
    memcpy = statistics.median(times["memcpy"])
    huge = f"huge pages: sender {args.sender_huge or '-'}, reader {args.reader_huge or '-'}"
    print(f"{args.mib} MiB, {args.rounds} rounds, {args.per_call} iovecs per call, {huge}")
    for name, samples in times.items():
        median = statistics.median(samples)
        ratios = sorted(m / s for m, s in zip(times["memcpy"], samples, strict=True))
        low, high = ratios[len(ratios) // 4], ratios[(3 * len(ratios)) // 4]
        print(f"{name:12s} {median * 1e3:7.1f} ms  {memcpy / median:5.2f} x memcpy ({low:.2f}-{high:.2f})")


if __name__ == "__main__":
    main()
