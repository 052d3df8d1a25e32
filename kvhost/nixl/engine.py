"""What an engine holds, as its peers must know it, and whether two engines can work together.

Two engines that hand KV blocks over must agree on the model (layers, KV heads, head dim,
dtype, cache kind); everything else kvhost serves: any block sizes that divide one
another, any region order (head-major, token-major), any tensor parallelism whose ranks
share the heads evenly, either way. An ``EngineSpec`` is exchanged when two engines
connect (``kvhost.nixl.peers``), and ``refusal`` decides there, once, in one line that
names the field and both values: a pair that cannot be served never starts, so it can
neither fail per request later nor corrupt bytes silently (bfloat16 and float16 have the
same size; only their names tell them apart).

``table_refusal`` checks that a rank's ``RegionTable`` is what its engine's spec says.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from kvhost.errors import ArgumentError
from kvhost.nixl.errors import ProtocolError
from kvhost.nixl.fields import Fields
from kvhost.nixl.tables import RegionTable

KINDS = ("mha", "mla")  # K and V per KV head; one latent per token (not split by heads)
# Item sizes of the dtypes an engine may name; the name, not the size, must agree.
DTYPE_SIZES = {
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}
MAX_RANKS = 1024  # tensor-parallel ranks of one engine
MAX_HEADS = 1 << 16
MAX_HEAD_DIM = 1 << 24
MAX_LAYERS = 1 << 15
MAX_BLOCK_SIZE = 1 << 24


class IncompatibleEngineError(ProtocolError):
    """Two engines that kvhost cannot serve together; the message names the field and both values."""


@dataclass(frozen=True)
class EngineSpec:
    """One engine's cache as its peers must know it (one table per rank travels beside it).

    ``layout`` is the memory order of one block region, in letters (``HNC`` head-major,
    ``NHC`` token-major, ``NC`` for MLA's latent or for heads kept outside the block,
    ``KNHC`` with K inside it): what ``RegionTable.order`` says. For
    ``mha`` the ``kv_heads`` are shared evenly by the ``tp_size`` ranks; an ``mla`` cache
    has one latent per token (``head_dim`` channels, ``kv_heads`` 1) that every rank holds
    whole.
    """

    kind: str
    layers: int
    kv_heads: int
    head_dim: int
    dtype: str
    block_size: int
    layout: str
    tp_size: int

    def __post_init__(self) -> None:
        problem = self.problem()
        if problem:
            raise ArgumentError(problem)

    @property
    def heads_per_rank(self) -> int:
        return self.kv_heads // self.tp_size if self.kind == "mha" else 1

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]

    def problem(self) -> str | None:
        """Why this spec cannot describe an engine, or None."""
        if self.kind not in KINDS:
            return f"kind: {self.kind!r} is not one of {KINDS}"
        if not isinstance(self.dtype, str) or self.dtype not in DTYPE_SIZES:
            return f"dtype: {self.dtype!r} is not one of {sorted(DTYPE_SIZES)}"
        for name, most in (
            ("layers", MAX_LAYERS),
            ("kv_heads", MAX_HEADS),
            ("head_dim", MAX_HEAD_DIM),
            ("block_size", MAX_BLOCK_SIZE),
            ("tp_size", MAX_RANKS),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= most:
                return f"{name}: expected an integer in [1, {most}], got {value!r}"
        layout = self.layout
        if not isinstance(layout, str) or len(set(layout)) != len(layout) or not set(layout) <= set("LKHNC"):
            return f"layout: {layout!r} must be distinct letters of 'LKHNC'"
        if "N" not in layout or "C" not in layout:
            return f"layout: {layout!r} lacks N or C"
        if self.kind == "mla" and (set(layout) & set("KH") or self.kv_heads != 1):
            return (
                f"kind: an mla cache has one latent per token (kv_heads 1, no K or H), got {self.kv_heads}, {layout!r}"
            )
        if self.kind == "mha" and self.kv_heads % self.tp_size:
            return f"kv_heads: {self.kv_heads} cannot be shared evenly by tp_size {self.tp_size} ranks"
        return None

    def describe(self) -> str:
        tp = f", TP {self.tp_size}" if self.tp_size > 1 else ""
        heads = f"{self.kv_heads} KV heads x {self.head_dim}" if self.kind == "mha" else f"latent {self.head_dim}"
        return f"{self.kind} {self.layers} layers x {heads} {self.dtype}, {self.layout} blocks of {self.block_size}{tp}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any, where: str = "engine") -> EngineSpec:
        """A peer's spec, every field checked: a malformed one is a ProtocolError naming the field."""
        fields = Fields(data, where)
        try:
            return cls(
                kind=fields.text("kind", max_length=8),
                layers=fields.integer("layers", minimum=1, maximum=MAX_LAYERS),
                kv_heads=fields.integer("kv_heads", minimum=1, maximum=MAX_HEADS),
                head_dim=fields.integer("head_dim", minimum=1, maximum=MAX_HEAD_DIM),
                dtype=fields.text("dtype", max_length=32),
                block_size=fields.integer("block_size", minimum=1, maximum=MAX_BLOCK_SIZE),
                layout=fields.text("layout", max_length=8),
                tp_size=fields.integer("tp_size", minimum=1, maximum=MAX_RANKS),
            )
        except ValueError as err:
            if isinstance(err, ProtocolError):
                raise
            raise ProtocolError(f"{where}.{err}") from None


def refusal(
    local: EngineSpec, remote: EngineSpec, *, local_name: str = "local", remote_name: str = "remote"
) -> str | None:
    """Why kvhost cannot serve this pair, in one line naming the field and both values; None
    when it can (whatever the block sizes that divide, layouts and tensor parallelism)."""

    def differ(name: str, mine: object, theirs: object, why: str) -> str:
        return f"{name}: {local_name} {mine}, {remote_name} {theirs} ({why})"

    for name in ("kind", "dtype", "layers", "head_dim"):
        mine, theirs = getattr(local, name), getattr(remote, name)
        if mine != theirs:
            return differ(name, mine, theirs, "must agree")
    if local.kv_heads != remote.kv_heads:
        return differ(
            "kv_heads",
            f"{local.kv_heads} ({local.heads_per_rank} per rank x {local.tp_size})",
            f"{remote.kv_heads} ({remote.heads_per_rank} per rank x {remote.tp_size})",
            "the model's KV heads must agree",
        )
    big, small = max(local.block_size, remote.block_size), min(local.block_size, remote.block_size)
    if big % small:
        return differ("block_size", local.block_size, remote.block_size, "neither divides the other")
    if sorted(local.layout) != sorted(remote.layout):
        return differ("layout", local.layout, remote.layout, "blocks that hold different letters")
    return None


def check_compatible(local: EngineSpec, remote: EngineSpec, *, local_name: str, remote_name: str) -> None:
    """``refusal`` as an IncompatibleEngineError."""
    why = refusal(local, remote, local_name=local_name, remote_name=remote_name)
    if why is not None:
        raise IncompatibleEngineError(why)


def table_refusal(spec: EngineSpec, rank: int, table: RegionTable) -> str | None:
    """Why rank ``rank``'s table is not what ``spec`` says (one line naming the field), or None."""
    problem = table_shape_refusal(spec, rank, table)
    if problem is not None:
        return problem
    # Layer names, each with the layers an L axis holds (a cross-layer tensor is one name).
    layers = len({s.layer for s in table.streams}) * table.sizes.get("L", 1)
    if layers != spec.layers:
        return f"rank {rank} table: {layers} layers, the engine says {spec.layers}"
    return None


def table_shape_refusal(spec: EngineSpec, rank: int, table: RegionTable) -> str | None:
    """``table_refusal``'s checks of what a table holds per block (sizes, item size, order),
    which need none of its streams: a peer's table is held to them before its streams are
    read, so that its sizes bound their coordinates."""
    where = f"rank {rank} table"
    want: Mapping[str, int] = {"N": spec.block_size, "C": spec.head_dim}
    if spec.kind == "mha":
        want = {**want, "H": spec.heads_per_rank}
    for letter, size in want.items():
        got = table.sizes.get(letter)
        if got != size:
            return f"{where}: {letter} is {got}, the engine says {size}"
    if spec.kind == "mla" and table.sizes.get("H", 1) != 1:
        return f"{where}: an mla cache has no heads, the table has H {table.sizes['H']}"
    if "K" in table.sizes and table.sizes["K"] != (2 if spec.kind == "mha" else 1):
        keys = "K and V: 2" if spec.kind == "mha" else "one latent: no K"
        return f"{where}: K is {table.sizes['K']}, an {spec.kind} cache has {keys}"
    if table.itemsize != spec.itemsize:
        return f"{where}: item size {table.itemsize}, the engine's {spec.dtype} has {spec.itemsize}"

    # A letter of size 1 moves no byte wherever it sits (one head per rank, blocks of one
    # token): a permuted view may place it apart from what the engine names.
    def placed(order: str) -> str:
        return "".join(a for a in order if table.sizes.get(a) != 1)

    if placed(table.order) != placed(spec.layout):
        return f"{where}: region order {table.order!r}, the engine says {spec.layout!r}"
    return None
