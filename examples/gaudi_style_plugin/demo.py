"""The worked example end to end, on CPU tensors: ``python examples/gaudi_style_plugin/demo.py``.

A CUDA-style prefill engine (FlashAttention cache, fp8, heads-first blocks of 2 tokens)
hands two requests to a Gaudi-style decode engine (fused-slot (K, V) caches stored as
uint8, token-major blocks of 8). NIXL's reads are played from the sender's real bytes;
the decode engine then post-processes both requests in one call and stages them to a
heads-first host buffer in another. Every token is checked against the sender.

With this distribution installed, the backend is loaded through its ``kvhost.backends``
entry point, as kvhost's registry loads it; otherwise it is imported directly. It serves
``hpu`` tensors but runs the same code on these CPU tensors. Prints a JSON summary.
"""

from __future__ import annotations

import json
from importlib.metadata import entry_points

import torch
from kvhost_gaudi_style import GaudiStyleBackend, GaudiStyleCaches

from kvhost.integrations.vllm import RemoteEngine
from kvhost.testing import assert_same_tokens, fill_random, make_cache, nixl_read

LAYERS, BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM = 2, 16, 8, 2, 16


def load_backend() -> tuple[GaudiStyleBackend, str]:
    """The backend class as kvhost's registry finds it, if this distribution is installed."""
    found = [point for point in entry_points(group="kvhost.backends") if point.name == "gaudi-style"]
    if found:
        return found[0].load()(), f"entry point {found[0].value}"
    return GaudiStyleBackend(), "module import"


def main() -> dict[str, object]:
    backend, source = load_backend()
    # The decode engine's caches as it allocates them: per layer (K, V), fused slots, fp8 as bytes.
    engine = {
        f"layers.{i}": (
            fill_random(torch.empty(BLOCKS * BLOCK_SIZE, HEADS, HEAD_DIM, dtype=torch.uint8), 2 * i),
            fill_random(torch.empty(BLOCKS * BLOCK_SIZE, HEADS, HEAD_DIM, dtype=torch.uint8), 2 * i + 1),
        )
        for i in range(LAYERS)
    }
    decode = GaudiStyleCaches(engine, BLOCK_SIZE, backend=backend)

    # The sender: FlashAttention [2, B, N, H, C] in float8 with heads-first memory, blocks of 2.
    sizes = dict(K=2, B=12, N=2, H=HEADS, C=HEAD_DIM)
    prefill = {name: make_cache("KBNHC", "KBHNC", sizes, torch.float8_e4m3fn) for name in engine}
    for i, tensor in enumerate(prefill.values()):
        fill_random(tensor, 100 + i)
    requests = {"req-1": ([5, 9], [0, 3, 4, 7, 8, 1, 2, 11]), "req-2": ([12], [6, 10, 5, 9])}
    for local_ids, remote_ids in requests.values():
        nixl_read(prefill, "KBNHC", remote_ids, decode.views, decode.axes, local_ids)

    received = {"prefill-0": {name: local for name, (local, _) in requests.items()}}
    stats = decode.post_process(received, {"prefill-0": RemoteEngine("HND", 2)})
    for local_ids, remote_ids in requests.values():
        assert_same_tokens(decode.views, decode.axes, local_ids, prefill, "KBNHC", remote_ids)

    # Staging for a heads-first peer: the copy rearranges on the way, no rewrite pass.
    host = decode.host_buffers(physical="KBHNC")
    saved = decode.save_to_host(host, {name: local for name, (local, _) in requests.items()}).wait()
    for local_ids, remote_ids in requests.values():
        assert_same_tokens(host, decode.axes, local_ids, prefill, "KBNHC", remote_ids)

    return {
        "backend": stats.backend,
        "loaded_by": source,
        "post_process": {"requests": stats.requests, "blocks": stats.blocks, "groups": stats.groups},
        "save": {"backend": saved.backend, "blocks": saved.blocks, "runs": saved.runs},
        "checked": True,
    }


if __name__ == "__main__":
    print(json.dumps(main()))
