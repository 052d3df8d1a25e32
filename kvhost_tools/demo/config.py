"""What the engines of a hand-off agree on, as typed values: the model, the workload, each engine's cache.

Every engine derives the same request lengths and token values from the ``Model`` and
the ``Workload`` (the seed), so decode verifies bit for bit what no prefill sent it.
An engine's own cache is an ``EngineShape`` (layout, block size, tensor parallelism).
Request ``n`` is held by the prefill engine ``n mod P`` and read by the decode engine
``n mod D`` (``Share``). Block ids are drawn in one place, ``allocate_blocks``.

Nothing here imports kvhost or torch at module level: ``kvhost demo`` checks its options
and starts the engine processes without either (importing torch takes seconds on a busy
machine). The few limits it shares with the library are repeated here, and a test checks
that they agree.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvhost_tools.blocks import MAX_RUN, free_list

if TYPE_CHECKING:
    import torch

    from kvhost.nixl.engine import EngineSpec

AXES = {"mha": "KBNHC", "mla": "BNC"}  # shape order of every cache of a kind
LAYOUTS = {"NHD": "KBNHC", "HND": "KBHNC", "MLA": "BNC"}  # memory orders: token-major, head-major, a latent
# As kvhost.nixl.engine.DTYPE_SIZES, kvhost.nixl.handshake.MAX_REQUESTS and MAX_TOKENS say.
DTYPE_SIZES = {
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}
DTYPES = tuple(DTYPE_SIZES)
MAX_REQUESTS = 1 << 14
MAX_TOKENS = 1 << 24
# 0: every request verified; 1: only that requests failed (did not arrive, or mismatched);
# 2: anything else (bad options, engines that cannot work together, a hand-off that could not run).
EXIT_OK, EXIT_FAILED, EXIT_ERROR = 0, 1, 2


class DemoError(RuntimeError):
    """The hand-off could not run: an engine failed to start, or a pool is too small."""


def os_reason(err: OSError) -> str:
    """An OSError in the system's words (``No space left on device``), else as it says itself."""
    return os.strerror(err.errno) if err.errno else str(err)


@dataclass(frozen=True)
class Model:
    """What every engine must agree on (the handshake refuses engines that do not)."""

    kind: str  # mha or mla
    layers: int
    heads: int  # KV heads of the model (1 for mla)
    head_dim: int  # channels per head, or of the latent
    dtype_name: str

    @property
    def axes(self) -> str:
        return AXES[self.kind]

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype_name]

    @property
    def dtype(self) -> torch.dtype:
        import torch

        dtype: torch.dtype = getattr(torch, self.dtype_name)
        return dtype

    @property
    def kv(self) -> int:
        """K and V per head (2), or one latent (1)."""
        return 2 if self.kind == "mha" else 1

    def spec(self, shape: EngineShape) -> EngineSpec:
        from kvhost.nixl.engine import EngineSpec

        return EngineSpec(
            self.kind, self.layers, self.heads, self.head_dim, self.dtype_name, shape.block_size, shape.order, shape.tp
        )

    def token_bytes(self) -> int:
        """Bytes of one token of every layer (all heads)."""
        return self.layers * self.kv * self.heads * self.head_dim * self.itemsize

    def caches(
        self, shape: EngineShape, num_blocks: int, device: str | torch.device = "cpu"
    ) -> dict[str, torch.Tensor]:
        """One rank's caches on ``device``: every layer, the rank's heads (all of an mla latent)."""
        from kvhost.testing import make_cache

        heads = self.heads // shape.tp if self.kind == "mha" else 1
        sizes = dict(L=self.layers, K=2, B=num_blocks, N=shape.block_size, H=heads, C=self.head_dim)
        memory = shape.physical
        if shape.cross_layer:  # one tensor, a block's layers back to back: one block region holds them all
            return {"layers": make_cache(self.axes_for(shape), memory, sizes, self.dtype, device)}
        return {
            f"layer{i}": make_cache(self.axes, memory, {a: sizes[a] for a in memory}, self.dtype, device)
            for i in range(self.layers)
        }

    def axes_for(self, shape: EngineShape) -> str:
        """The axes of ``caches(shape, ...)``'s tensors: ``L`` first where they hold every layer."""
        return "L" + self.axes if shape.cross_layer else self.axes


@dataclass(frozen=True)
class EngineShape:
    """One engine's own cache: its layout (``HND``, ``NHD``; ``MLA`` for a latent), block size and
    TP; ``cross_layer``: every layer in one buffer, a block's layers back to back (vLLM's
    cross-layer layout), so that a run of blocks is one span of memory for all layers."""

    layout: str
    block_size: int
    tp: int = 1
    cross_layer: bool = False

    @classmethod
    def of_order(cls, order: str, block_size: int, tp: int = 1) -> EngineShape | None:
        """The shape whose region order is ``order`` (as a peer's ``EngineSpec.layout`` says
        it), or None where no layout here has it."""
        for layout in LAYOUTS:
            for cross_layer in (False, True):
                shape = cls(layout, block_size, tp, cross_layer=cross_layer)
                if shape.order == order:
                    return shape
        return None

    @property
    def physical(self) -> str:
        """The memory order of a cache tensor: the layout's, with the layers inside the block
        (``L`` right after ``B``) where they share one tensor."""
        memory = LAYOUTS[self.layout]
        return "BL" + memory.replace("B", "") if self.cross_layer else memory

    @property
    def order(self) -> str:
        """The region's memory order in letters, as ``RegionTable.order`` says it."""
        return self.physical.split("B", 1)[1]

    @property
    def layers_note(self) -> str:
        """What a description adds where the cache is not a tensor per layer."""
        return ", layers inside blocks" if self.cross_layer else ""

    def describe(self) -> str:
        tp = f", TP {self.tp}" if self.tp > 1 else ""
        return f"{self.layout} (memory {self.physical}), block {self.block_size} tokens{tp}{self.layers_note}"


@dataclass(frozen=True)
class Share:
    """Which requests an engine takes: those whose number is ``index`` mod ``count``."""

    index: int = 0
    count: int = 1

    def holds(self, number: int) -> bool:
        return number % self.count == self.index

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


@dataclass(frozen=True)
class Workload:
    """The batch: request lengths, seeded; the seed also keys every token's values."""

    requests: int
    min_tokens: int
    max_tokens: int
    seed: int
    block_ids: str = "runs"  # as allocators hand them out; or "scattered"
    max_run: int = MAX_RUN  # runs of 1..max_run consecutive blocks: smaller is more fragmented

    def lengths(self) -> list[int]:
        """Token counts of the requests: log-uniform in [min_tokens, max_tokens], seeded."""
        rng = np.random.default_rng([self.seed, 1])
        logs = rng.uniform(math.log(self.min_tokens), math.log(self.max_tokens + 1), self.requests)
        return [min(int(math.exp(x)), self.max_tokens) for x in logs]

    def numbers(self, share: Share) -> list[int]:
        return [n for n in range(self.requests) if share.holds(n)]

    def lengths_of(self, share: Share) -> list[int]:
        """Token counts of the requests ``share`` holds (the lengths drawn once)."""
        every = self.lengths()
        return [every[n] for n in self.numbers(share)]


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def local_blocks_for(remote_blocks: int, remote_block_size: int, block_size: int) -> int:
    """Local blocks that hold ``remote_blocks`` sender blocks (whole groups when the sender's are larger)."""
    if remote_block_size > block_size:
        return remote_blocks * (remote_block_size // block_size)
    return -(-remote_blocks // (block_size // remote_block_size))


def pool_for(blocks: Sequence[int]) -> int:
    """The blocks a side allocates for requests of ``blocks`` blocks: all of them, and spares."""
    return sum(blocks) + max(4, sum(blocks) // 8)


def allocate_blocks(
    pool: int, counts: Sequence[int], workload: Workload, stream: int
) -> tuple[list[list[int]], list[int]]:
    """Block ids for requests of ``counts`` blocks out of ``pool``, and the ids left spare:
    the one place the demo draws block ids, seeded by the workload's seed and ``stream``, as
    the workload says (``kvhost_tools.blocks.free_list``: runs of 1..``max_run`` consecutive
    blocks in random order, as allocators hand them out, or ``scattered``)."""
    if sum(counts) > pool:
        raise DemoError(f"{sum(counts)} blocks needed, the pool holds {pool}")
    rng = np.random.default_rng([workload.seed, stream])
    free = free_list(pool, rng, workload.block_ids, workload.max_run).tolist()
    taken, start = [], 0
    for count in counts:
        taken.append(free[start : start + count])
        start += count
    return taken, free[start:]


# Option: (least, most). The most are what an offer can carry (requests, tokens, streams of
# layers x K/V, sizes in a block table), so no engine refuses another's offer for its size.
OPTION_RANGES = {
    "layers": (1, (1 << 16) // 2),
    "heads": (1, 1 << 16),
    "head_dim": (1, 1 << 24),
    "requests": (1, MAX_REQUESTS),
    "min_tokens": (1, MAX_TOKENS),
    "max_tokens": (1, MAX_TOKENS),
    "seed": (0, (1 << 63) - 1),
    "max_run": (1, 1 << 20),
    "block_size": (1, MAX_TOKENS),
    "tp": (1, 1024),
}


def range_refusal(option: str, value: int | None, name: str | None = None) -> str | None:
    least, most = OPTION_RANGES[name or option.lstrip("-").replace("-", "_")]
    if value is not None and not least <= value <= most:
        return f"{option} must be in [{least}, {most}], got {value}"
    return None


def model_refusal(model: Model, workload: Workload, shapes: Sequence[tuple[str, EngineShape]]) -> str | None:
    """Why the model, the workload or an engine (``(option prefix, shape)``) is impossible, naming the option."""
    for option, value in (
        ("--layers", model.layers),
        ("--heads", model.heads),
        ("--head-dim", model.head_dim),
        ("--requests", workload.requests),
        ("--min-tokens", workload.min_tokens),
        ("--max-tokens", workload.max_tokens),
        ("--seed", workload.seed),
        ("--max-run", workload.max_run),
    ):
        problem = range_refusal(option, value)
        if problem:
            return problem
    if workload.max_tokens < workload.min_tokens:
        return f"--max-tokens {workload.max_tokens} is below --min-tokens {workload.min_tokens}"
    for prefix, shape in shapes:
        problem = range_refusal(f"--{prefix}block-size", shape.block_size, "block_size") or range_refusal(
            f"--{prefix}tp", shape.tp, "tp"
        )
        if problem:
            return problem
        if model.kind == "mha" and model.heads % shape.tp:
            return f"--heads {model.heads} cannot be shared out evenly to --{prefix}tp {shape.tp} ranks"
        if (model.kind == "mla") != (shape.layout == "MLA"):
            return f"--{prefix}layout {shape.layout} does not hold a {model.kind} cache (MLA is the layout of mla)"
    return None


def memory_needed(model: Model, workload: Workload, prefill: EngineShape, decode: EngineShape, *, staging: bool) -> int:
    """Bytes the engines of one host allocate for one prefill and one decode engine, estimated
    before anything is: prefill's cache, decode's (twice with a host buffer shaped like it)
    and its memcpy yardstick, and working memory for the largest request (its values as
    32-bit words, a few times over)."""
    lengths = workload.lengths()
    return (
        _prefill_cache(model, lengths, prefill.block_size)
        + _decode_cache(model, lengths, prefill.block_size, decode.block_size, staging=staging)
        + _yardstick(model, lengths)
        + _working(model, lengths, prefill.block_size)
    )


def prefill_memory(model: Model, workload: Workload, prefill: EngineShape, share: Share) -> int:
    """``memory_needed``'s share for one prefill engine alone, holding the requests of ``share``."""
    lengths = workload.lengths_of(share) or [0]
    return _prefill_cache(model, lengths, prefill.block_size) + _working(model, lengths, prefill.block_size)


def decode_memory(model: Model, workload: Workload, decode: EngineShape, share: Share, *, staging: bool) -> int:
    """``memory_needed``'s share for one decode engine alone, reading the requests of ``share``
    (from prefill blocks of its own size: the least its cache can be)."""
    lengths = workload.lengths_of(share) or [0]
    cache = _decode_cache(model, lengths, decode.block_size, decode.block_size, staging=staging)
    return cache + _yardstick(model, lengths) + _working(model, lengths, decode.block_size)


def _prefill_cache(model: Model, lengths: list[int], block_size: int) -> int:
    return cache_bytes(model, pool_for([blocks_for(t, block_size) for t in lengths]), block_size)


def _decode_cache(model: Model, lengths: list[int], prefill_block_size: int, block_size: int, *, staging: bool) -> int:
    blocks = [local_blocks_for(blocks_for(t, prefill_block_size), prefill_block_size, block_size) for t in lengths]
    return cache_bytes(model, pool_for(blocks), block_size, staging=staging)


def cache_bytes(model: Model, pool: int, block_size: int, *, staging: bool = False) -> int:
    """An engine's cache of ``pool`` blocks (twice, with a host buffer shaped like it)."""
    return model.token_bytes() * pool * block_size * (2 if staging else 1)


def _working(model: Model, lengths: list[int], block_size: int) -> int:
    """Working memory for the largest request: its values as 32-bit words, a few times over."""
    return blocks_for(max(lengths), block_size) * block_size * model.kv * model.heads * model.head_dim * 4 * 8


def _yardstick(model: Model, lengths: list[int]) -> int:
    """Decode's memcpy yardstick for these requests: its two buffers."""
    return 2 * yardstick_bytes(sum(lengths) * model.token_bytes())


def yardstick_bytes(batch_bytes: int) -> int:
    """The size of decode's memcpy yardstick for a batch of ``batch_bytes``: 1 to 64 MiB."""
    return min(max(batch_bytes, 1 << 20), 64 << 20)


# An engine process's own memory, measured here (its peak VmRSS with a tiny cache): Python,
# torch, numpy, NIXL and UCX take 275-380 MB, and each further tensor-parallel rank (its
# agents, UCX's threads) some 24 MB more (TP 32: 1.03-1.14 GB).
ENGINE_BYTES = 400 << 20
RANK_BYTES = 25 << 20


def engines_memory(shapes: Sequence[EngineShape]) -> int:
    """The engine processes' own memory, beyond their caches: one per shape."""
    return sum(ENGINE_BYTES + RANK_BYTES * (shape.tp - 1) for shape in shapes)


def memory_refusal(needed: int, model: Model, workload: Workload, *, engines: Sequence[EngineShape] = ()) -> str | None:
    """Why the options need more memory than this machine has left (one line naming the
    options that size it), or None: said before anything is allocated. ``engines``: the
    processes still to start (the demo's), whose own memory counts too."""
    processes = engines_memory(engines)
    available = _short_of(needed + processes)
    if available is None:
        return None
    started = f" and {processes / 1e9:,.1f} GB for {len(engines)} engine processes" if engines else ""
    return (
        f"--layers {model.layers} x --heads {model.heads} x --head-dim {model.head_dim} x --dtype "
        f"{model.dtype_name}, --requests {workload.requests} of --min-tokens {workload.min_tokens} to "
        f"--max-tokens {workload.max_tokens} need {needed / 1e9:,.1f} GB for the caches{started}, more than the "
        f"{available / 1e9:,.1f} GB of memory available"
    )


def offer_memory_refusal(model: Model, shape: EngineShape, pool: int, *, staging: bool) -> str | None:
    """Why decode's cache of ``pool`` blocks, sized by what the prefill engines offered (a
    sender's larger blocks take more of ours than decode's own block size let it foresee),
    needs more memory than is left, or None: said before it is allocated."""
    needed = cache_bytes(model, pool, shape.block_size, staging=staging)
    available = _short_of(needed)
    if available is None:
        return None
    return (
        f"the offered requests take {pool:,} blocks of {shape.block_size} tokens here, {needed / 1e9:,.1f} GB "
        f"for the caches, more than the {available / 1e9:,.1f} GB of memory available"
    )


def _short_of(needed: int) -> int | None:
    """The memory left, where it is less than ``needed`` bytes; None where it is enough (or unknown)."""
    available = memory_available()
    return available if available is not None and needed > available else None


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
