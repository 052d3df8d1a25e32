"""One connector step, timed side by side: ``python examples/vllm_step_timing.py``.

A decode worker with FlashAttention caches (token-major blocks of 16) post-processes a
step's worth of requests from a heads-first sender with the same block size. Compared in
one process, medians of several repetitions, as ratios to a plain copy of the same bytes:

- ``memcpy``: copying the bytes once (an in-place rearrangement reads and writes each once);
- ``per request, torch``: the loop connectors run today, per request and per layer:
  gather the blocks, permute, scatter back;
- ``per request, adapter``: ``VllmCaches.post_process`` called once per request;
- ``batch, adapter``: ``VllmCaches.post_process`` once for the whole step;
- ``batch, KVHost``: ``kvhost.KVHost.receive`` once, to show what the adapter adds.

The bytes are rearranged over and over (the rearrangement is not its own inverse, so each
repetition scrambles further): only the time matters here, correctness is the tests' job.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

import kvhost
from kvhost.integrations.vllm import RemoteEngine, VllmCaches


def per_request_torch(caches: dict[str, torch.Tensor], requests: dict[str, list[int]]) -> None:
    """The per-request loop: one index tensor, and gather/permute/scatter per layer, per request."""
    for ids in requests.values():
        index = torch.tensor(ids)
        for cache in caches.values():
            _, _, tokens, heads, channels = cache.shape
            blocks = cache.index_select(1, index)  # [2, n, N, H, C] holding HNC bytes per block
            wire = blocks.reshape(2, len(ids), heads, tokens, channels)
            cache.index_copy_(1, index, wire.transpose(2, 3).contiguous())


def median_seconds(run: Callable[[], object], repeats: int) -> float:
    run()  # warm up: plans, kernels, allocations
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--blocks-per-request", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()

    heads, head_dim, block_size = 8, 128, 16
    num_blocks = 2 * args.requests * args.blocks_per_request
    caches = {
        f"model.layers.{i}.self_attn.attn": torch.randn(2, num_blocks, block_size, heads, head_dim).bfloat16()
        for i in range(args.layers)
    }
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0)).tolist()
    requests = {
        f"req-{r}": order[r * args.blocks_per_request : (r + 1) * args.blocks_per_request] for r in range(args.requests)
    }
    engines = {"prefill": RemoteEngine("HND", block_size)}
    worker = VllmCaches(caches, "flash_attn")
    registered = kvhost.KVHost(caches, axes="KBNHC")

    blocks = args.requests * args.blocks_per_request
    moved = blocks * args.layers * 2 * block_size * heads * head_dim * 2
    source, target = torch.empty(moved, dtype=torch.uint8), torch.empty(moved, dtype=torch.uint8)
    methods: dict[str, Callable[[], object]] = {
        "memcpy": lambda: target.copy_(source),
        "per request, torch": lambda: per_request_torch(caches, requests),
        "per request, adapter": lambda: [
            worker.post_process({"prefill": {name: ids}}, engines) for name, ids in requests.items()
        ],
        "batch, adapter": lambda: worker.post_process({"prefill": requests}, engines),
        "batch, KVHost": lambda: registered.receive(requests, remote_order="HNC", remote_block_size=block_size),
    }
    seconds = {name: median_seconds(run, args.repeats) for name, run in methods.items()}
    memcpy = seconds["memcpy"]
    print(
        json.dumps(
            {
                "backend": worker.backend.name,
                "threads": torch.get_num_threads(),
                "bytes": moved,
                "requests": args.requests,
                "layers": args.layers,
                "repeats": args.repeats,
                "time_over_memcpy": {name: round(s / memcpy, 2) for name, s in seconds.items()},
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
