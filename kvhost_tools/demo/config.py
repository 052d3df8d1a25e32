"""What both processes of the demo agree on: the command line as typed values.

Decode starts prefill with its own options, so both derive the same request lengths, block
ids and token values from one ``Config``. The options' least and most values are what a
hello can carry, so decode never refuses its own prefill's hello; ``refusal`` names the
first impossible option before anything starts.
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass

import numpy as np
import torch

from kvhost.errors import KVHostError
from kvhost.nixl import MAX_STREAMS
from kvhost.nixl.handshake import MAX_REQUESTS, MAX_TOKENS
from kvhost.testing import make_cache

AXES = "KBNHC"  # shape order of every cache here; the layout name sets the memory order
LAYOUTS = {"NHD": "KBNHC", "HND": "KBHNC"}  # token-major, head-major
DTYPES = {
    name: getattr(torch, name)
    for name in ("bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2", "int8", "uint8")
}
# 0: every request verified; 1: only that requests failed (did not arrive, or mismatched);
# 2: anything else (bad options, the hand-off could not run).
EXIT_OK, EXIT_FAILED, EXIT_ERROR = 0, 1, 2


class DemoError(KVHostError, RuntimeError):
    """The hand-off could not run: prefill failed to start, or a pool is too small."""


@dataclass(frozen=True)
class Config:
    """The command line (``kvhost demo --help``), every option as a typed value."""

    # The batch and the model.
    requests: int
    min_tokens: int
    max_tokens: int
    layers: int
    heads: int
    head_dim: int
    dtype: torch.dtype
    seed: int
    # Both sides' caches, and how decode lands and rearranges the bytes.
    prefill_block_size: int
    decode_block_size: int
    prefill_layout: str
    decode_layout: str
    decode_ranks: int
    via_host: bool
    backend: str | None
    # Faults, limits and output.
    kill_prefill_after: int | None
    freeze_prefill_after: int | None
    inflight: int
    timeout: float
    connect_timeout: float
    json_path: str | None
    progress: bool
    # Set by decode when it starts prefill.
    role: str
    port: int
    hold_timeout: float

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    @property
    def fault_after(self) -> int | None:
        """Requests to let arrive before prefill is killed or frozen; None: no fault."""
        return self.kill_prefill_after if self.kill_prefill_after is not None else self.freeze_prefill_after

    def lengths(self) -> list[int]:
        """Token counts of the requests: log-uniform in [min_tokens, max_tokens], seeded."""
        rng = np.random.default_rng([self.seed, 1])
        logs = rng.uniform(math.log(self.min_tokens), math.log(self.max_tokens + 1), self.requests)
        return [min(int(math.exp(x)), self.max_tokens) for x in logs]

    def caches(
        self, layout: str, num_blocks: int, block_size: int, heads: int | None = None
    ) -> dict[str, torch.Tensor]:
        """Every layer's cache; ``heads`` less than the model's for one decode rank's share."""
        sizes = dict(K=2, B=num_blocks, N=block_size, H=heads or self.heads, C=self.head_dim)
        return {f"layer{i}": make_cache(AXES, LAYOUTS[layout], sizes, self.dtype) for i in range(self.layers)}


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def pool_for(blocks: list[int]) -> int:
    """The blocks a side allocates for requests of ``blocks`` blocks: all of them, and spares."""
    return sum(blocks) + max(4, sum(blocks) // 8)


# Option: (least, most). The most are what the hello can carry (requests, tokens, streams
# of layers x K/V, sizes in a block table), so decode never refuses its own prefill's hello.
OPTION_RANGES = {
    "prefill_block_size": (1, MAX_TOKENS),
    "decode_block_size": (1, MAX_TOKENS),
    "layers": (1, MAX_STREAMS // 2),
    "heads": (1, 1 << 24),
    "head_dim": (1, 1 << 24),
    "requests": (1, MAX_REQUESTS),
    "min_tokens": (1, MAX_TOKENS),
    "max_tokens": (1, MAX_TOKENS),
    "seed": (0, (1 << 63) - 1),
    "inflight": (1, MAX_REQUESTS),
    "decode_ranks": (1, 1 << 24),
    "kill_prefill_after": (0, MAX_REQUESTS),
    "freeze_prefill_after": (0, MAX_REQUESTS),
    "port": (0, 65535),
}


def refusal(config: Config) -> str | None:
    """Why the options are impossible (one line naming the option), or None."""
    for name, (least, most) in OPTION_RANGES.items():
        value = getattr(config, name)
        if value is not None and not least <= value <= most:
            return f"--{name.replace('_', '-')} must be in [{least}, {most}], got {value}"
    big, small = sorted((config.prefill_block_size, config.decode_block_size), reverse=True)
    if big % small:
        return f"block sizes {config.prefill_block_size} and {config.decode_block_size} must divide one another"
    if config.heads % config.decode_ranks:
        return f"--heads {config.heads} cannot be shared out evenly to {config.decode_ranks} decode ranks"
    if config.decode_ranks > 1 and config.prefill_layout != "HND":
        return (
            "--decode-ranks needs --prefill-layout HND: a token-major sender scatters a share of heads over every token"
        )
    if config.max_tokens < config.min_tokens:
        return f"--max-tokens {config.max_tokens} is below --min-tokens {config.min_tokens}"
    if config.role == "prefill":
        if config.port < 1:
            return f"--port must be in [1, 65535] for prefill, got {config.port}"
        return None  # decode checked the memory before starting it, and holds some of it by now
    needed, available = memory_needed(config), memory_available()
    if available is not None and needed > available:
        return (
            f"{memory_options(config)} need {needed / 1e9:,.1f} GB for the caches of both processes, "
            f"more than the {available / 1e9:,.1f} GB of memory available"
        )
    return None


def memory_options(config: Config) -> str:
    """The options that size the caches, as given."""
    text = (
        f"--layers {config.layers} x --heads {config.heads} x --head-dim {config.head_dim} x "
        f"--dtype {config.dtype_name}, --requests {config.requests} of --min-tokens {config.min_tokens} to "
        f"--max-tokens {config.max_tokens}, --prefill-block-size {config.prefill_block_size}, "
        f"--decode-block-size {config.decode_block_size}"
    )
    return text + (", --via-host" if config.via_host else "")


def memory_needed(config: Config) -> int:
    """Bytes both processes allocate, estimated before anything is: prefill's cache, decode's
    (twice with ``--via-host``: the host buffer is shaped like it), and working memory for
    the largest request (its values as 32-bit words, a few times over)."""
    itemsize = int(torch.empty(0, dtype=config.dtype).element_size())
    per_token = config.layers * 2 * config.heads * config.head_dim * itemsize
    prefill = [blocks_for(t, config.prefill_block_size) for t in config.lengths()]
    decode = [blocks_for(n * config.prefill_block_size, config.decode_block_size) for n in prefill]
    pools = [pool_for(blocks) for blocks in (prefill, decode)]
    caches = per_token * (
        pools[0] * config.prefill_block_size + pools[1] * config.decode_block_size * (2 if config.via_host else 1)
    )
    largest = max(prefill) * config.prefill_block_size
    working = largest * 2 * config.heads * config.head_dim * 4 * 8
    return int(caches + working)


def memory_available() -> int | None:
    """Memory this process may still take: MemAvailable, less where a cgroup limit is lower."""
    available = None
    with contextlib.suppress(OSError, ValueError, IndexError), open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    if available is None:
        with contextlib.suppress(OSError, ValueError, AttributeError):
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    with (
        contextlib.suppress(OSError, ValueError),
        open("/sys/fs/cgroup/memory.max") as limit,
        open("/sys/fs/cgroup/memory.current") as current,
    ):
        text = limit.read().strip()
        if text != "max":
            left = int(text) - int(current.read())
            available = left if available is None else min(available, left)
    return available
