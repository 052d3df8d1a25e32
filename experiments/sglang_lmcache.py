"""Host copies as SGLang's HiCache and LMCache make them, kvhost beside the loops they replace.

docs/integrations.md ("SGLang and LMCache") shows how their units map onto kvhost's
blocks; this times those calls side by side with a memcpy of the same bytes and a torch
loop over layers (one index-and-assign per layer, as a connector without kernels of its
own would write it), interleaved rounds, medians:

    python experiments/sglang_lmcache.py [--rounds 9] [--layers 16]

- ``lmcache-save``: a request of 16 chunks of 256 tokens (blocks of 16 in runs of 4 to 12,
  as an allocator hands them out) saved from vLLM-style ``[2, blocks, 16, heads, head_dim]``
  caches into ``KV_2LTD`` chunks ``[2, L, 256, heads * head_dim]``: kvhost a call per chunk
  (blocks of one token, the slot mapping as ids), the loop a gather per layer and chunk;
- ``hicache-backup``: 256 scattered pages of 16 tokens from SGLang-style per-layer
  ``[2, rows, heads, head_dim]`` pools into a ``layer_first`` host pool: kvhost one call
  (page ids), the loop an index-and-assign of the pages' tokens per layer.

Each way's bytes are checked against the loop's once before timing. Fractions of memcpy
are the roofline's median time over the way's, the roofline the faster of two copies of
the same bytes between two buffers (``np.copyto`` on one thread, torch's ``copy_`` over
its threads), as ``kvhost bench`` takes it.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

import kvhost

HEADS, HEAD_DIM, BLOCK = 8, 128, 16
DTYPE = torch.bfloat16


def allocator_runs(count: int, total: int, rng: np.random.Generator) -> np.ndarray:
    """``count`` distinct ids of ``total`` in runs of 4 to 12, the runs in random order."""
    starts = rng.permutation(total // 12)[: -(-count // 4)] * 12
    runs = [np.arange(s, s + rng.integers(4, 13)) for s in starts]
    return np.concatenate(runs)[:count]


def lmcache_save(layers: int, rng: np.random.Generator) -> tuple[dict[str, Callable[[], object]], torch.Tensor]:
    chunks, chunk_tokens = 16, 256
    blocks = chunks * chunk_tokens // BLOCK
    caches = {f"layer{layer}": torch.randn(2, 4 * blocks, BLOCK, HEADS, HEAD_DIM).to(DTYPE) for layer in range(layers)}
    block_ids = torch.from_numpy(allocator_runs(blocks, 4 * blocks, rng))
    slot_mapping = (block_ids[:, None] * BLOCK + torch.arange(BLOCK)).flatten()
    out = torch.empty(chunks, 2, layers, chunk_tokens, HEADS * HEAD_DIM, dtype=DTYPE)
    saved = list(out)  # a chunk apiece, each a tensor of its own to the copies
    slots = kvhost.KVHost({name: c.view(2, -1, 1, HEADS, HEAD_DIM) for name, c in caches.items()}, axes="KBNHC")
    chunk_views = [
        {name: chunk[:, layer].view(2, -1, 1, HEADS, HEAD_DIM) for layer, name in enumerate(caches)} for chunk in saved
    ]
    chunk_slots = [slot_mapping[i * chunk_tokens : (i + 1) * chunk_tokens].numpy() for i in range(chunks)]
    flat = [c.view(2, -1, HEADS * HEAD_DIM) for c in caches.values()]
    chunk_index = [torch.from_numpy(s) for s in chunk_slots]
    ids = range(chunk_tokens)

    def kvhost_way() -> None:
        for view, s in zip(chunk_views, chunk_slots):
            slots.copy_to(view, s, ids).wait()

    def loop_way() -> None:
        for chunk, index in zip(saved, chunk_index):
            for layer, cache in enumerate(flat):
                chunk[:, layer] = cache[:, index]

    return {"kvhost": kvhost_way, "loop": loop_way}, out


def hicache_backup(layers: int, rng: np.random.Generator) -> tuple[dict[str, Callable[[], object]], torch.Tensor]:
    pages, pool_pages = 256, 1024
    rows = (pool_pages + 1) * BLOCK
    fused = [torch.randn(2, rows, HEADS, HEAD_DIM).to(DTYPE) for _ in range(layers)]
    host_pool = torch.empty(2, layers, pages * BLOCK, HEADS, HEAD_DIM, dtype=DTYPE)
    device_pages = rng.permutation(np.arange(1, pool_pages + 1))[:pages]
    host_pages = rng.permutation(pages)
    pages_of = {f"layer{layer}": f.view(2, -1, BLOCK, HEADS, HEAD_DIM) for layer, f in enumerate(fused)}
    pool = kvhost.KVHost(pages_of, axes="KBNHC")
    host = {f"layer{layer}": host_pool[:, layer].view(2, -1, BLOCK, HEADS, HEAD_DIM) for layer in range(layers)}
    device_tokens = torch.from_numpy((device_pages[:, None] * BLOCK + np.arange(BLOCK)).reshape(-1))
    host_tokens = torch.from_numpy((host_pages[:, None] * BLOCK + np.arange(BLOCK)).reshape(-1))

    def kvhost_way() -> None:
        pool.copy_to(host, device_pages, host_pages).wait()

    def loop_way() -> None:
        for layer, f in enumerate(fused):
            host_pool[:, layer, host_tokens] = f[:, device_tokens]

    return {"kvhost": kvhost_way, "loop": loop_way}, host_pool


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--layers", type=int, default=16)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    print(f"torch threads {torch.get_num_threads()}, layers {args.layers}, rounds {args.rounds}")
    for name, make in (("lmcache-save", lmcache_save), ("hicache-backup", hicache_backup)):
        ways, out = make(args.layers, rng)
        ways["loop"]()
        want = out.clone()
        out.zero_()
        ways["kvhost"]()
        assert torch.equal(out, want), f"{name}: kvhost's bytes differ from the loop's"
        nbytes = out.numel() * out.element_size()
        src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.zeros(nbytes, dtype=torch.uint8)
        ways["np.copyto"] = functools.partial(np.copyto, dst.numpy(), src.numpy())  # one thread
        ways["copy_"] = functools.partial(dst.copy_, src)  # over torch's threads
        times: dict[str, list[float]] = {way: [] for way in ways}
        for _ in range(args.rounds):
            for way, run in ways.items():
                start = time.perf_counter()
                run()
                times[way].append(time.perf_counter() - start)
        medians = {way: statistics.median(t) for way, t in times.items()}
        memcpy = min(medians["np.copyto"], medians["copy_"])  # the roofline: the faster of the two
        print(f"{name}: {nbytes / 1e6:.0f} MB")
        for way in ("np.copyto", "copy_", "loop", "kvhost"):
            print(f"  {way:9} {medians[way] * 1e3:8.2f} ms  {memcpy / medians[way]:.2f} of memcpy")
        print(f"  kvhost / loop: {medians['loop'] / medians['kvhost']:.2f}x")


if __name__ == "__main__":
    main()
