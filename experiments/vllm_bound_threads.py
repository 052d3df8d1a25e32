"""Which CPUs kvhost's kernels get inside a vLLM 0.33 CPU worker, following vLLM's own steps.

vLLM binds in two places. The executor starts each CPU worker process with OpenMP variables
naming its cores (``configure_omp_envs``: without a preloaded OpenMP, ``OMP_PLACES`` as one
place of all the worker's cores and ``OMP_PROC_BIND=true``). Then, after the model is loaded
and profiled, ``initialize_from_config`` builds the KV connector, and the NIXL worker's
``__init__`` binds the thread that builds it (the worker's main thread) to one reserved
core per NUMA node (``os.sched_setaffinity(0, ...)``). kvhost's CPU backend, and numba with
it, first loads when the connector registers its caches, on that same thread.

Each scenario runs in a fresh process (numba counts its threads once, at import):

- ``vllm``: the steps above in vLLM's order, vLLM's own topology and binding;
- ``unbound``: the same steps with the connector's binding left out (vLLM's tests do this);

and reports, at each step, whether numba is loaded, the main thread's CPUs, numba's thread
count and threading layer, every thread's CPUs after the first receive, and the median time
of a receive of ``--mib`` MiB (HND blocks of 16 tokens into NHD blocks of 64):

    VLLM_TARGET_DEVICE=cpu ~/.cache/kvhost/venv-vllm0.33.0-py3.11/bin/python \\
        experiments/vllm_bound_threads.py [--cores 0-1] [--mib 64] [--repeats 15]

``--cores`` is what ``VLLM_CPU_OMP_THREADS_BIND`` would name for the worker (vLLM's automatic
choice reserves a core for the scheduler and one for NIXL, which on a 2-core machine leaves
the worker none).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from unittest.mock import patch

ROOT = Path(__file__).resolve().parent.parent


def thread_cpus() -> dict[str, str]:
    """Each thread of this process: its name and the CPUs it may run on."""
    found = {}
    for task in sorted(Path("/proc/self/task").iterdir(), key=lambda p: int(p.name)):
        status = dict(line.split(":\t", 1) for line in (task / "status").read_text().splitlines() if ":\t" in line)
        name = status["Name"].strip()
        if not name.startswith(("gloo", "pt_")):  # torch.distributed's own, never bound
            found[f"{task.name} {name}"] = status["Cpus_allowed_list"].strip()
    return found


def child(scenario: str, mib: int, repeats: int) -> dict[str, object]:
    """One scenario, in this (fresh) process; the env already holds vLLM's OpenMP variables."""
    sys.path[:0] = [str(ROOT), str(ROOT / "backends"), str(ROOT / "tests")]
    steps: list[dict[str, object]] = []

    def step(name: str) -> None:
        entry: dict[str, object] = {
            "step": name,
            "numba_loaded": "numba" in sys.modules,
            "main_thread_cpus": sorted(os.sched_getaffinity(0)),
        }
        if "numba" in sys.modules:
            entry["numba_num_threads"] = sys.modules["numba"].config.NUMBA_NUM_THREADS
        steps.append(entry)

    import torch
    import vllm.v1.worker.cpu_worker  # noqa: F401  (what a CPU worker process imports first)

    step("worker modules imported")
    torch.ones(1 << 24).sum()  # the model's load and profile run: torch's first parallel regions
    step("after torch's first parallel region")

    import test_vllm_connector as rig
    from vllm.config import set_current_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from vllm.platforms import current_platform

    model = rig.write_model(Path(tempfile.mkdtemp()), rig.HEADS)
    config = rig.make_config(model, "LBHNC")
    port = 29500 + os.getpid() % 1000
    with set_current_vllm_config(config):
        init_distributed_environment(1, 0, f"tcp://127.0.0.1:{port}", 0, "gloo")
        initialize_model_parallel(1, 1)
    kv_cache_config, caches = rig.allocate("LBHNC")
    base = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker"
    topology = current_platform.discover_numa_topology if scenario == "vllm" else (lambda: [])
    with (
        set_current_vllm_config(config),
        patch(f"{base}.NixlWrapper", rig.FakeNixlWrapper),
        patch(f"{base}.check_nixl_version", lambda version: None),
        patch.object(current_platform, "discover_numa_topology", topology),
    ):
        connector = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, kv_cache_config)
        step("connector built (vLLM's NIXL worker __init__)")
        connector.register_kv_caches(caches)
    step("caches registered")

    import kvhost

    tokens, heads, head_dim, remote_block = 64, 8, 128, 16
    block_bytes = 2 * tokens * heads * head_dim * 2  # K and V, bf16
    layers = 8
    blocks = max(1, mib * 2**20 // (block_bytes * layers))
    big = {f"l{i}": torch.zeros(2, blocks, tokens, heads, head_dim, dtype=torch.bfloat16) for i in range(layers)}
    requests = {"r": list(range(blocks))}

    def receive() -> None:
        kvhost.receive(big, requests, axes="KBNHC", remote_order="HNC", remote_block_size=remote_block)

    receive()
    step("after the first receive")
    import numba

    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        receive()
        times.append(time.perf_counter() - start)
    return {
        "scenario": scenario,
        "backend": kvhost.get_backend(torch.device("cpu")).name,
        "steps": steps,
        "numba_get_num_threads": numba.get_num_threads(),
        "threading_layer": numba.threading_layer(),
        "threads_after_receive": thread_cpus(),
        "receive_bytes": blocks * block_bytes * layers,
        "receive_ms_median": 1e3 * statistics.median(times),
        "receive_ms_all": [round(1e3 * t, 3) for t in times],
        "omp_env": {k: os.environ[k] for k in ("OMP_NUM_THREADS", "OMP_PLACES", "OMP_PROC_BIND") if k in os.environ},
    }


def omp_env(cores: str) -> dict[str, str]:
    """The OpenMP variables vLLM 0.33's ``configure_omp_envs`` sets for a worker on ``cores``
    (no OpenMP library preloaded), ``cores`` read by vLLM's own parser of the binding."""
    from vllm.utils.cpu_resource_utils import parse_id_list

    ids = parse_id_list(cores)
    listed = ",".join(str(i) for i in ids)
    return {"OMP_NUM_THREADS": str(len(ids)), "OMP_PLACES": f"{{{listed}}}", "OMP_PROC_BIND": "true"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cores", default="0-1", help="the worker's cores, as VLLM_CPU_OMP_THREADS_BIND names them")
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--child", choices=("vllm", "unbound"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.mib, args.repeats)))
        return
    env = {**os.environ, **omp_env(args.cores), "VLLM_TARGET_DEVICE": "cpu"}
    for scenario in ("vllm", "unbound", "vllm", "unbound"):  # interleaved: the machine is shared
        command = [sys.executable, __file__, "--child", scenario, "--mib", str(args.mib)]
        command += ["--repeats", str(args.repeats)]
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, check=False)
        if done.returncode != 0:
            sys.exit(f"{scenario}: exit {done.returncode}\n{done.stderr[-4000:]}")
        result = json.loads(done.stdout.strip().splitlines()[-1])
        print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
