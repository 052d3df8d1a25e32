"""Runs one large-piece case of tests/test_large_pieces.py in a process of its own.

    python tests/large_pieces_worker.py BACKEND DEVICE SPEC_JSON

``BACKEND`` is a registered backend name, or ``triton-interpret`` for the Triton kernels
in Triton's interpreter (needs ``TRITON_INTERPRET=1``); ``DEVICE`` is where the caches
live (``cpu``, ``xla``, ``cuda``...). ``SPEC_JSON`` describes one receive or one copy (see
``run_receive`` and ``run_copy``). The bytes are checked with the conformance oracle
(``kvhost.testing``): every block the call writes reads back as what was sent, every
other block keeps its sentinel bytes. On success the last line of stdout is a JSON
report; a wrong byte raises (exit status 1, the oracle's message on stderr); memory used
after it was freed typically ends the process with a signal, which the test reports.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import torch

DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "uint8": torch.uint8,
}


def backend_for(name: str, tile_bytes: int | None, cpu_ways: dict[str, Any] | None = None) -> Any:
    """The backend to pass as ``backend=``. ``tile_bytes``: the interpreted kernels' tile
    (the interpreter's cost is per operation, so large tiles make large pieces affordable);
    ``cpu_ways``: the CPU backend's constructor arguments (``cycle_piece_bytes``,
    ``cycle_run_bytes``, ``copy_walk``), which choose the ways its kernels take."""
    if name == "cpu" and cpu_ways is not None:
        from kvhost_cpu import CpuBackend

        return CpuBackend(**cpu_ways)
    if name == "triton-interpret":
        from dataclasses import replace

        from kvhost_accelerator.interpret import TritonInterpretBackend

        limits = TritonInterpretBackend.limits
        backend = TritonInterpretBackend(replace(limits, tile_bytes=tile_bytes) if tile_bytes else limits)
        reason = backend.unavailable_reason()
        if reason is not None:
            raise SystemExit(f"triton-interpret: {reason}")
        return backend
    return name


def caches_for(spec: dict[str, Any], axes: str, sizes: dict[str, int], device: str, layers: int) -> dict[str, Any]:
    from kvhost.testing import make_cache

    dtype = DTYPES[spec["dtype"]]
    # Shape order is memory order (XLA tensors have no other): every target runs every case.
    return {f"layer{i}": make_cache(axes, axes, sizes, dtype, device) for i in range(layers)}


def run_receive(spec: dict[str, Any], backend: Any, device: str) -> dict[str, Any]:
    """``spec``: axes, sizes (with B), dtype, layers, order and remote (the sender), requests (name -> ids)."""
    import kvhost
    from kvhost.testing import ReceiveCase

    caches = caches_for(spec, spec["axes"], spec["sizes"], device, spec["layers"])
    case = ReceiveCase(caches, spec["axes"], seed=spec.get("seed", 1))
    for name, ids in spec["requests"].items():
        case.send(name, ids, spec["order"], spec["remote"])
    start = time.perf_counter()
    stats = kvhost.receive(
        caches,
        spec["requests"],
        axes=spec["axes"],
        remote_order=spec["order"],
        remote_block_size=spec["remote"],
        backend=backend,
    )
    seconds = time.perf_counter() - start
    case.check()
    return {"backend": stats.backend, "bytes_moved": stats.bytes_moved, "groups": stats.groups, "seconds": seconds}


def run_copy(spec: dict[str, Any], backend: Any, device: str) -> dict[str, Any]:
    """``spec``: src_axes, dst_axes, sizes (logical, B for the source), dst_blocks, dtype,
    layers, src_ids, dst_ids, src_device and dst_device (``host`` or ``device``)."""
    import kvhost
    from kvhost.testing import CopyCase, fill_random

    where = {"host": "cpu", "device": device}
    src_sizes = {a: spec["sizes"][a] for a in spec["src_axes"]}
    dst_sizes = dict(src_sizes, B=spec["dst_blocks"])
    src = caches_for(spec, spec["src_axes"], src_sizes, where[spec["src_device"]], spec["layers"])
    dst = caches_for(spec, spec["dst_axes"], dst_sizes, where[spec["dst_device"]], spec["layers"])
    for i, tensor in enumerate([*src.values(), *dst.values()]):
        fill_random(tensor, 7 + i)
    case = CopyCase(src, dst, spec["src_axes"], spec["dst_axes"])
    src_ids, dst_ids = spec["src_ids"], spec["dst_ids"]
    start = time.perf_counter()
    result = kvhost.copy_blocks(
        src, dst, src_ids, dst_ids, axes=spec["src_axes"], dst_axes=spec["dst_axes"], backend=backend
    )
    result.wait()
    seconds = time.perf_counter() - start
    case.check(src_ids, dst_ids)
    return {"backend": result.backend, "bytes_moved": result.bytes_moved, "seconds": seconds}


def main(argv: list[str]) -> None:
    backend_name, device, spec_json = argv
    spec = json.loads(spec_json)
    if device == "xla":
        import torch_xla  # noqa: F401  (torch knows the XLA device only once torch_xla is imported)
    import kvhost

    backend = backend_for(backend_name, spec.get("triton_tile_bytes"), spec.get("cpu_ways"))
    report = run_receive(spec, backend, device) if spec["op"] == "receive" else run_copy(spec, backend, device)
    instance = backend if isinstance(backend, kvhost.Backend) else kvhost.get_backend(device, backend)
    report["describe"] = instance.describe()  # e.g. "numba kernels": the path that ran
    print(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1:])
