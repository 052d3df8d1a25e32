"""Every bad input is a KVHostError naming the value at fault, and changes no byte.

One table, one row per bad input: the call, the error type, a fragment of its message.
Every receive row carries a valid request that needs work beside the bad part, so a front
end that moved bytes before it had checked the whole call would be caught by the
snapshot of every tensor; nothing may be coerced (a bool is not a block id, 4.9 is not a
block size, "" is not an order).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch

import kvhost
from kvhost.testing import ReceiveCase, fill_random, make_cache, raw

SIZES = dict(K=2, B=8, N=8, H=2, C=4)
GOOD = {"good": [1, 2]}  # wired as head-major blocks of 4 tokens: the call has work to do


@dataclass
class World:
    """Caches wired with a valid request, a host buffer, and a registered KVHost."""

    caches: dict[str, torch.Tensor]
    host: dict[str, torch.Tensor]
    kv: kvhost.KVHost

    def snapshot(self) -> list[torch.Tensor]:
        return [raw(t).clone() for t in [*self.caches.values(), *self.host.values()]]

    def same_as(self, saved: list[torch.Tensor]) -> bool:
        return all(torch.equal(raw(t), s) for t, s in zip([*self.caches.values(), *self.host.values()], saved))


def world() -> World:
    caches = {f"layer{i}": make_cache("KBNHC", "KBNHC", SIZES) for i in range(2)}
    case = ReceiveCase(caches, "KBNHC", seed=4)
    case.send("good", GOOD["good"], "HNC", 4)
    host = {name: fill_random(make_cache("KBNHC", "KBHNC", SIZES), 9) for name in caches}
    return World(caches, host, kvhost.KVHost(caches, axes="KBNHC"))


def receive(requests: Any, **kwargs: Any) -> Callable[[World], object]:
    call = dict(axes="KBNHC", remote_order="HNC", remote_block_size=4) | kwargs
    return lambda w: kvhost.receive(w.caches, requests, **call)


def registered_receive(requests: Any, **kwargs: Any) -> Callable[[World], object]:
    call = dict(remote_order="HNC", remote_block_size=4) | kwargs
    return lambda w: w.kv.receive(requests, **call)


def copy(src_ids: Any, dst_ids: Any, **kwargs: Any) -> Callable[[World], object]:
    call = dict(axes="KBNHC") | kwargs
    return lambda w: kvhost.copy_blocks(w.caches, w.host, src_ids, dst_ids, **call)


class Wrapped(torch.Tensor):
    """A wrapper subclass with no storage of its own, as torchao's float8 tensors or DTensor."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> Wrapped:
        return torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined,no-any-return]
            cls, inner.shape, strides=inner.stride(), dtype=inner.dtype, device=inner.device
        )

    def __init__(self, inner: torch.Tensor) -> None:
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        unwrap = lambda x: x.inner if isinstance(x, Wrapped) else x  # noqa: E731
        return func(*torch.utils._pytree.tree_map(unwrap, args), **torch.utils._pytree.tree_map(unwrap, kwargs or {}))


def fake_caches() -> dict[str, torch.Tensor]:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        return {"w": torch.ones(2, 8, 8, 2, 4)}


def quantized(values: torch.Tensor) -> torch.Tensor:
    with warnings.catch_warnings():  # torch deprecates making them, not having them
        warnings.simplefilter("ignore")
        return torch.quantize_per_tensor(values, 0.1, 0, torch.quint8)


def nested(*rows: torch.Tensor) -> torch.Tensor:
    with warnings.catch_warnings():  # a prototype API, says torch
        warnings.simplefilter("ignore")
        return torch.nested.nested_tensor(list(rows))


class Unprintable:
    def __repr__(self) -> str:
        raise RuntimeError("no repr")


def gen() -> Any:
    return (i for i in [3, 4])


Row = tuple[Callable[[World], object], type[kvhost.KVHostError], str]
ROWS: dict[str, Row] = {
    # Block ids of the wrong kind: containers.
    "ids None": (receive(GOOD | {"bad": None}), kvhost.RequestError, "request 'bad': block ids must be a list"),
    "ids generator": (receive(GOOD | {"bad": gen()}), kvhost.RequestError, "got generator"),
    "ids int": (receive(GOOD | {"bad": 3}), kvhost.RequestError, "got int 3"),
    "ids bytes": (receive(GOOD | {"bad": b"\x03\x04"}), kvhost.RequestError, "got bytes b'\\x03\\x04'"),
    "ids str": (receive(GOOD | {"bad": "34"}), kvhost.RequestError, "got str '34'"),
    "ids set": (receive(GOOD | {"bad": {3, 4}}), kvhost.RequestError, "got set {3, 4}"),
    "ids dict keys": (receive(GOOD | {"bad": {3: 0, 4: 0}.keys()}), kvhost.RequestError, "got dict_keys"),
    "ids dict": (receive(GOOD | {"bad": {3: 0}}), kvhost.RequestError, "got dict {3: 0}"),
    # Block ids of the wrong kind: elements.
    "ids bools": (receive(GOOD | {"bad": [True, False]}), kvhost.RequestError, "got True at position 0"),
    "ids numpy bool": (receive(GOOD | {"bad": [np.bool_(True)]}), kvhost.RequestError, "got np.True_ at position 0"),
    "ids floats": (receive(GOOD | {"bad": [3.0]}), kvhost.RequestError, "got 3.0 at position 0"),
    "ids None inside": (receive(GOOD | {"bad": [3, None]}), kvhost.RequestError, "got None at position 1"),
    # numpy counts a timedelta64 among its signed integers; it is not a block id.
    "ids timedelta": (
        receive(GOOD | {"bad": [3, np.timedelta64(4)]}),
        kvhost.RequestError,
        "got np.timedelta64(4) at position 1",
    ),
    "copy dst ids timedelta": (copy([1], [np.timedelta64(2, "s")]), kvhost.RequestError, "dst_ids: block ids must be"),
    "ids nested tensor": (
        receive(GOOD | {"bad": nested(torch.tensor([3, 4]))}),
        kvhost.RequestError,
        "request 'bad': block ids must be a dense tensor, got a nested tensor",
    ),
    "ids bool array": (receive(GOOD | {"bad": np.array([True])}), kvhost.RequestError, "array of bool"),
    "ids float array": (receive(GOOD | {"bad": np.array([3.0])}), kvhost.RequestError, "array of float64"),
    "ids float tensor": (receive(GOOD | {"bad": torch.tensor([3.0])}), kvhost.RequestError, "torch.float32"),
    "ids bool tensor": (receive(GOOD | {"bad": torch.tensor([True])}), kvhost.RequestError, "torch.bool"),
    "ids 2-D": (receive(GOOD | {"bad": np.array([[3, 4]])}), kvhost.RequestError, "shape (1, 2)"),
    "ids out of range": (receive(GOOD | {"bad": [3, 8]}), kvhost.RequestError, "block id 8 at position 1"),
    "ids range past len": (receive(GOOD | {"bad": range(2**64)}), kvhost.RequestError, "block id 8 at position 8"),
    "ids range below 0": (receive(GOOD | {"bad": range(3, -5, -1)}), kvhost.RequestError, "id -1 at position 4"),
    "ids bits tensor": (
        receive(GOOD | {"bad": torch.zeros(2, dtype=torch.uint8).view(torch.bits8)}),
        kvhost.RequestError,
        "must be integers, got an array of torch.bits8",
    ),
    "ids sparse tensor": (
        receive(GOOD | {"bad": torch.tensor([3, 4]).to_sparse()}),
        kvhost.RequestError,
        "request 'bad': block ids must be a dense tensor, got a torch.sparse_coo tensor",
    ),
    "ids meta tensor": (
        receive(GOOD | {"bad": torch.zeros(2, dtype=torch.int64, device="meta")}),
        kvhost.RequestError,
        "meta device",
    ),
    # The identity (token-major both sides, same block size) moves nothing, but its ids must
    # still be what it counts.
    "identity ids 0-d array": (
        receive({"a": np.array(3)}, remote_order="NHC", remote_block_size=8),
        kvhost.RequestError,
        "shape ()",
    ),
    "identity ids 2-D array": (
        receive({"a": np.array([[1, 2], [3, 4]])}, remote_order="NHC", remote_block_size=8),
        kvhost.RequestError,
        "shape (2, 2)",
    ),
    "identity ids float array": (
        receive({"a": np.array([1.0])}, remote_order="NHC", remote_block_size=8),
        kvhost.RequestError,
        "array of float64",
    ),
    "identity ids range past len": (
        receive({"a": range(2**64)}, remote_order="NHC", remote_block_size=8),
        kvhost.RequestError,
        "block id 8 at position 8",
    ),
    # ... and whole groups of a sender's block, as the checked path owes them.
    "identity ids not whole groups": (
        receive({"a": [1, 2], "b": [3]}, remote_order="NHC", remote_block_size=16),
        kvhost.RequestError,
        "request 'b': 1 block ids are not whole groups of 2",
    ),
    # Request ids are names: strings, shown in part where they are huge.
    "request id int": (receive(GOOD | {7: [3]}), kvhost.RequestError, "request ids must be strings, got 7 (int)"),
    "request id None": (receive(GOOD | {None: [3]}), kvhost.RequestError, "got None (NoneType)"),
    "identity request id int": (
        receive({"a": [1], 7: [3]}, remote_order="NHC", remote_block_size=8),
        kvhost.RequestError,
        "request ids must be strings, got 7 (int)",
    ),
    "request id unprintable": (
        receive(GOOD | {Unprintable(): [3]}),
        kvhost.RequestError,
        "got a Unprintable (Unprintable)",
    ),
    "request id huge": (
        receive(GOOD | {"x" * 10**6: [3, 8]}),
        kvhost.RequestError,
        f"request '{'x' * 196}...: block id 8 at position 1 is out of range",
    ),
    # The call's own remote spec is checked even when every request brings its own.
    "call size bad, requests their own": (
        receive({"good": kvhost.Incoming([1, 2], "HNC", 4)}, remote_block_size=3),
        kvhost.ArgumentError,
        "remote_block_size 3: block sizes 8 (local) and 3 (remote) do not divide one another",
    ),
    "call order bad, no requests": (receive({}, remote_order="KHC"), kvhost.ArgumentError, "remote_order 'KHC'"),
    # ... and alike when requests take it: the fault is the call's, not the first request's.
    "call order bad, requests take it": (receive(GOOD, remote_order="KHC"), kvhost.ArgumentError, "remote_order 'KHC'"),
    "ids in an Incoming": (
        receive(GOOD | {"bad": kvhost.Incoming({3, 4}, "HNC", 4)}),
        kvhost.RequestError,
        "request 'bad': block ids must be a list",
    ),
    # The call's shape.
    "requests list": (receive([[1, 2]]), kvhost.RequestError, "requests must be a mapping"),
    "requests None": (receive(None), kvhost.RequestError, "got NoneType"),
    "caches list": (
        lambda w: kvhost.receive(list(w.caches.values()), GOOD, axes="KBNHC", remote_order="HNC", remote_block_size=4),
        kvhost.LayoutError,
        "expected a mapping of layer name to tensor, got list",
    ),
    "caches None": (
        lambda w: kvhost.receive(None, GOOD, axes="KBNHC"),  # type: ignore[arg-type]
        kvhost.LayoutError,
        "got NoneType",
    ),
    "layer not a tensor": (
        lambda w: kvhost.receive(w.caches | {"x": np.zeros(3)}, GOOD, axes="KBNHC"),
        kvhost.LayoutError,
        "layer 'x' must be a tensor or a tuple of tensors, got ndarray",
    ),
    # The first layer is looked at before the set is read (to choose the backend and take
    # its lock): whatever it is, the fault is still named as the set's check names it.
    "first layer a list of ints": (
        lambda w: kvhost.receive({"x": [1, 2]} | w.caches, GOOD, axes="KBNHC"),
        kvhost.LayoutError,
        "layer 'x' must be a tensor or a tuple of tensors, got a list whose item 0 is 1",
    ),
    "first layer an empty tuple": (
        lambda w: kvhost.receive({"x": ()} | w.caches, GOOD, axes="KBNHC"),
        kvhost.LayoutError,
        "layer 'x' must be a tensor or a tuple of tensors, got an empty tuple",
    ),
    "a layer's tuple holding None": (
        lambda w: kvhost.receive({"x": (w.caches["layer0"][0], None)} | w.caches, GOOD, axes="KBNHC"),
        kvhost.LayoutError,
        "layer 'x' must be a tensor or a tuple of tensors, got a tuple whose item 1 is None",
    ),
    "first layer without rows": (
        lambda w: kvhost.receive({"x": torch.zeros(0, 4)} | w.caches, GOOD, axes="KBNHC"),
        kvhost.LayoutError,
        "layer 'x'",
    ),
    "first layer a tuple of one": (
        lambda w: kvhost.receive({"x": (w.caches["layer0"][0],)} | w.caches, GOOD, axes="KBNHC"),
        kvhost.LayoutError,
        "all layers must match",
    ),
    "first layer on two devices": (
        lambda w: kvhost.receive(
            {"x": tuple(w.caches["layer0"].to(d) for d in ("cpu", "meta"))}, GOOD, axes="KBNHC", backend="cpu"
        ),
        kvhost.LayoutError,
        "is on meta but layer 'x' is on cpu",
    ),
    "layers on two devices, a backend named": (
        lambda w: kvhost.receive({"zz": w.caches["layer0"].to("meta")} | w.caches, GOOD, axes="KBNHC", backend="cpu"),
        kvhost.LayoutError,
        "caches: layer 'layer0' is on cpu but layer 'zz' is on meta; one call serves one device",
    ),
    "tuple layers on two devices, a backend named": (
        lambda w: kvhost.receive(
            {"zz": tuple(w.caches["layer0"].to("meta").unbind(0))}
            | {n: tuple(t.unbind(0)) for n, t in w.caches.items()},
            GOOD,
            axes="KBNHC",
            backend="cpu",
        ),
        kvhost.LayoutError,
        "caches: layer 'layer0' is on cpu but layer 'zz' is on meta",
    ),
    "a scalar beside layers on another device, a backend named": (
        lambda w: kvhost.receive(
            {"zz": w.caches["layer0"].to("meta"), "x": torch.tensor(1.0)}, GOOD, axes="KBNHC", backend="cpu"
        ),
        kvhost.LayoutError,
        "caches: layer 'x' is on cpu but layer 'zz' is on meta",
    ),
    "no tensor beside layers on a device the named backend refuses": (
        lambda w: kvhost.receive({"zz": w.caches["layer0"].to("meta"), "x": "text"}, GOOD, axes="KBNHC", backend="cpu"),
        kvhost.BackendError,
        "backend 'cpu' does not serve device type 'meta'",
    ),
    "copy out of meta": (
        lambda w: kvhost.copy_blocks({n: t.to("meta") for n, t in w.caches.items()}, w.host, [0], [1], axes="KBNHC"),
        kvhost.LayoutError,
        "src layer 'layer0' is on meta: it has no bytes to copy to cpu",
    ),
    "layer name not a string": (
        lambda w: kvhost.receive(w.caches | {0: w.caches["layer0"].clone()}, GOOD, axes="KBNHC"),
        kvhost.LayoutError,
        "layer names must be strings, got 0",
    ),
    "axes not a string": (receive(GOOD, axes=list("KBNHC")), kvhost.LayoutError, "axes must be a string"),
    "axes None": (receive(GOOD, axes=None), kvhost.LayoutError, "got None"),
    "axes empty": (receive(GOOD, axes=""), kvhost.LayoutError, "axes must be a non-empty string"),
    # The sender's spec: never coerced.
    "order empty": (receive(GOOD, remote_order=""), kvhost.RequestError, "remote_order must be a non-empty string"),
    "order not a string": (receive(GOOD, remote_order=5), kvhost.RequestError, "got 5"),
    "order a list": (receive(GOOD, remote_order=list("HNC")), kvhost.RequestError, "got ['H', 'N', 'C']"),
    "order unknown letter": (receive(GOOD, remote_order="HXC"), kvhost.RequestError, "'X'; known letters are 'LKBNHC'"),
    "order named as vLLM names it": (receive(GOOD, remote_order="HND"), kvhost.RequestError, "is C here: 'HNC'"),
    "order lowercase": (receive(GOOD, remote_order="hnc"), kvhost.RequestError, "'chn'"),
    "block size 0": (receive(GOOD, remote_block_size=0), kvhost.RequestError, "must be a positive integer, got 0"),
    "block size negative": (receive(GOOD, remote_block_size=-4), kvhost.RequestError, "got -4"),
    "block size float": (receive(GOOD, remote_block_size=4.9), kvhost.RequestError, "got 4.9"),
    "block size whole float": (receive(GOOD, remote_block_size=4.0), kvhost.RequestError, "got 4.0"),
    "block size True": (receive(GOOD, remote_block_size=True), kvhost.RequestError, "got True"),
    "block size string": (receive(GOOD, remote_block_size="4"), kvhost.RequestError, "got '4'"),
    "block size timedelta": (
        receive(GOOD, remote_block_size=np.timedelta64(4)),
        kvhost.RequestError,
        "remote_block_size must be a positive integer, got np.timedelta64(4)",
    ),
    "Incoming tokens timedelta": (
        receive(GOOD | {"bad": kvhost.Incoming([3], "HNC", 4, tokens=np.timedelta64(3))}),
        kvhost.RequestError,
        "request 'bad': tokens must be a positive integer, got np.timedelta64(3)",
    ),
    "block size does not divide": (receive(GOOD, remote_block_size=3), kvhost.ArgumentError, "remote_block_size 3: "),
    "Incoming size 0": (
        receive(GOOD | {"bad": kvhost.Incoming([3], "HNC", 0)}),
        kvhost.RequestError,
        "request 'bad': remote_block_size must be a positive integer, got 0",
    ),
    "Incoming order empty": (
        receive(GOOD | {"bad": kvhost.Incoming([3], "", 4)}),
        kvhost.RequestError,
        "request 'bad': remote_order must be a non-empty string",
    ),
    "Incoming size True": (
        receive(GOOD | {"bad": kvhost.Incoming([3], "HNC", True)}),
        kvhost.RequestError,
        "request 'bad': remote_block_size must be a positive integer, got True",
    ),
    # Caches that cannot be addressed as blocks.
    "zero tokens per block": (
        lambda w: kvhost.receive({"z": torch.zeros(2, 8, 0, 2, 4)}, {"r": [1]}, axes="KBNHC"),
        kvhost.LayoutError,
        "N=0",
    ),
    "zero blocks": (
        lambda w: kvhost.receive({"z": torch.zeros(2, 0, 8, 2, 4)}, {"r": [1]}, axes="KBNHC"),
        kvhost.LayoutError,
        "B=0",
    ),
    "sparse tensor": (
        lambda w: kvhost.receive({"s": torch.zeros(2, 8, 8, 2, 4).to_sparse()}, GOOD, axes="KBNHC"),
        kvhost.LayoutError,
        "torch.sparse_coo tensor",
    ),
    "conjugated view": (
        lambda w: kvhost.receive({"c": torch.zeros(2, 8, 8, 2, 4, dtype=torch.complex64).conj()}, GOOD, axes="KBNHC"),
        kvhost.LayoutError,
        "conjugated",
    ),
    # A layout already checked for a tensor of the same shape and strides: the view's own
    # facts are checked all the same (the layout cache is keyed by shape and strides).
    "conjugated view of a known layout": (
        lambda w: (
            kvhost.receive({"c": torch.zeros(2, 8, 8, 2, 4, dtype=torch.complex64)}, GOOD, axes="KBNHC"),
            kvhost.receive({"c": torch.zeros(2, 8, 8, 2, 4, dtype=torch.complex64).conj()}, GOOD, axes="KBNHC"),
        ),
        kvhost.LayoutError,
        "conjugated",
    ),
    "negated view of a known layout": (
        lambda w: (
            kvhost.receive({"n": torch.zeros(2, 8, 8, 2, 4)}, GOOD, axes="KBNHC"),
            kvhost.receive({"n": torch._neg_view(torch.zeros(2, 8, 8, 2, 4))}, GOOD, axes="KBNHC"),
        ),
        kvhost.LayoutError,
        "negated",
    ),
    "conjugated view of a registered layout": (
        lambda w: (
            kvhost.KVHost({"c": torch.zeros(2, 8, 8, 2, 4, dtype=torch.complex64)}, axes="KBNHC"),
            kvhost.KVHost({"c": torch.zeros(2, 8, 8, 2, 4, dtype=torch.complex64).conj()}, axes="KBNHC"),
        ),
        kvhost.LayoutError,
        "conjugated",
    ),
    # Backends.
    "backend not a name": (
        receive(GOOD, backend=5),
        kvhost.BackendError,
        "backend must be a name, a kvhost.Backend or None, got 5",
    ),
    "backend unknown": (receive(GOOD, backend="nonesuch"), kvhost.BackendError, "'nonesuch'"),
    "get_backend name a list": (
        lambda w: kvhost.get_backend("cpu", ["cpu"]),  # type: ignore[arg-type]
        kvhost.BackendError,
        "a backend's name must be a string, got ['cpu']",
    ),
    # The registered object.
    "KVHost ids None": (registered_receive(GOOD | {"bad": None}), kvhost.RequestError, "request 'bad'"),
    "KVHost size 4.9": (registered_receive(GOOD, remote_block_size=4.9), kvhost.RequestError, "got 4.9"),
    "KVHost caches list": (
        lambda w: kvhost.KVHost(list(w.caches.values()), axes="KBNHC"),  # type: ignore[arg-type]
        kvhost.LayoutError,
        "got list",
    ),
    # Copies.
    "copy src ids None": (copy(None, [1]), kvhost.RequestError, "src_ids: block ids must be a list"),
    "copy dst ids set": (copy([1], {2}), kvhost.RequestError, "dst_ids: block ids must be a list"),
    "copy ids bools": (copy([True], [2]), kvhost.RequestError, "src_ids: block ids must be integers, got True"),
    "copy ids generator": (copy(gen(), [1, 2]), kvhost.RequestError, "got generator"),
    "copy ids int": (copy(1, 2), kvhost.RequestError, "got int 1"),
    "copy lengths differ": (copy([1, 2], [3]), kvhost.RequestError, "src_ids has 2 ids but dst_ids has 1"),
    "copy non_blocking string": (copy([1], [2], non_blocking="yes"), kvhost.RequestError, "got 'yes'"),
    "copy dst axes not a string": (copy([1], [2], dst_axes=5), kvhost.LayoutError, "axes must be a string"),
    "copy dst axes empty": (copy([1], [2], dst_axes=""), kvhost.LayoutError, "non-empty string of axis letters"),
    "copy dst axes False": (copy([1], [2], dst_axes=False), kvhost.LayoutError, "got False"),
    "copy src range past len": (copy(range(2**64), [1]), kvhost.RequestError, "source block id 8 at position 8"),
    "KVHost copy_to dst axes False": (
        lambda w: w.kv.copy_to(w.host, [1], [2], dst_axes=False),  # type: ignore[arg-type]
        kvhost.LayoutError,
        "got False",
    ),
    "KVHost copy_to dst axes a list": (
        lambda w: w.kv.copy_to(w.host, [1], [2], dst_axes=list("KBNHC")),  # type: ignore[arg-type]
        kvhost.LayoutError,
        "dst: axes must be a string of axis letters, got ['K', 'B', 'N', 'H', 'C']",
    ),
    "KVHost copy_from src axes a dict": (
        lambda w: w.kv.copy_from(w.host, [1], [2], src_axes={}),  # type: ignore[arg-type]
        kvhost.LayoutError,
        "src: axes must be a string of axis letters, got {}",
    ),
    "KVHost copy_to ids sparse": (
        lambda w: w.kv.copy_to(w.host, torch.tensor([1, 2]).to_sparse(), [3, 4]),
        kvhost.RequestError,
        "src_ids: block ids must be a dense tensor",
    ),
    "KVHost copy_from src axes empty": (
        lambda w: w.kv.copy_from(w.host, [1], [2], src_axes=""),
        kvhost.LayoutError,
        "non-empty string of axis letters",
    ),
    "KVHost layers unhashable": (
        registered_receive(GOOD, layers=[["layer0"]]),
        kvhost.ArgumentError,
        "layers[0]: ['layer0'] is not a registered layer",
    ),
    "nested tensor cache": (
        lambda w: kvhost.receive(
            {"n": torch.nested.nested_tensor([torch.zeros(8, 8, 2, 4), torch.zeros(8, 8, 2, 4)])}, GOOD, axes="KBNHC"
        ),
        kvhost.LayoutError,
        "a nested tensor has no one shape and strides",
    ),
    # Tensors with no memory behind them on the CPU: the kernels would write at address 0.
    "functional wrapper cache": (
        lambda w: kvhost.receive({"f": torch._to_functional_tensor(torch.zeros(2, 8, 8, 2, 4))}, GOOD, axes="KBNHC"),
        kvhost.LayoutError,
        "a Tensor with no memory of its own has no address",
    ),
    "wrapper subclass copy destination": (
        lambda w: kvhost.copy_blocks(
            {"w": torch.ones(2, 8, 8, 2, 4)}, {"w": Wrapped(torch.zeros(2, 8, 8, 2, 4))}, [0, 1], [2, 3], axes="KBNHC"
        ),
        kvhost.LayoutError,
        "dst layer 'w'[0]: a Wrapped with no memory of its own has no address",
    ),
    "fake tensor copy source": (
        lambda w: kvhost.copy_blocks(fake_caches(), {"w": torch.ones(2, 8, 8, 2, 4)}, [0, 1], [2, 3], axes="KBNHC"),
        kvhost.LayoutError,
        "a FakeTensor with no memory of its own has no address",
    ),
    "quantized cache": (
        lambda w: kvhost.receive(
            {"q": quantized(torch.zeros(2, 8, 8, 2, 4))},
            {"a": [1, 2]},
            axes="KBNHC",
            remote_order="HNC",
            remote_block_size=4,
        ),
        kvhost.LayoutError,
        "a quantized tensor (torch.quint8) keeps its scale apart from its bytes",
    ),
    "copy dst list": (
        lambda w: kvhost.copy_blocks(w.caches, list(w.host.values()), [1], [2], axes="KBNHC"),
        kvhost.LayoutError,
        "dst: expected a mapping",
    ),
    "KVHost copy_to ids bytes": (
        lambda w: w.kv.copy_to(w.host, b"\x01", [2], dst_axes="KBNHC"),
        kvhost.RequestError,
        "src_ids: block ids must be a list",
    ),
    "KVHost copy_from peer list": (
        lambda w: w.kv.copy_from(list(w.host.values()), [1], [2]),  # type: ignore[arg-type]
        kvhost.LayoutError,
        "src: expected a mapping",
    ),
}


@pytest.mark.parametrize("name", list(ROWS))
def test_bad_input_is_named_and_changes_nothing(name: str) -> None:
    call, error, fragment = ROWS[name]
    w = world()
    before = w.snapshot()
    with pytest.raises(kvhost.KVHostError) as raised:
        call(w)
    assert type(raised.value) is error or isinstance(raised.value, error), repr(raised.value)
    assert fragment in str(raised.value), f"{fragment!r} not in {raised.value}"
    assert w.same_as(before), "a rejected call changed bytes"


REFUSED_WITH_A_NEW_PEER_OR_LAYER_SET = {
    "copy_to, an id out of range": lambda w, host: w.kv.copy_to(host, [1], [99]),
    "copy_from, ids of two lengths": lambda w, host: w.kv.copy_from(host, [1, 2], [3]),
    "receive of some layers, a bad request": lambda w, host: w.kv.receive(
        GOOD | {"bad": [99]}, remote_order="HNC", remote_block_size=4, layers=["layer1"]
    ),
}


@pytest.mark.parametrize("name", list(REFUSED_WITH_A_NEW_PEER_OR_LAYER_SET))
def test_a_refused_call_leaves_the_registered_object_as_it_was(name: str) -> None:
    """What a KVHost remembers across calls (peers' layouts, sets of some layers, each
    keeping its tensors alive) is kept only once a call with it was planned: a refused
    call neither evicts a peer a connector uses nor keeps the refused buffer alive."""
    w = world()
    w.kv.copy_to(w.host, [1], [2])  # the connector's own host buffer, remembered
    remembered = (list(w.kv._peers._entries.values()), list(w.kv._some_layers._entries.values()))
    host = {name: tensor.clone() for name, tensor in w.host.items()}  # a peer never seen
    with pytest.raises(kvhost.KVHostError):
        REFUSED_WITH_A_NEW_PEER_OR_LAYER_SET[name](w, host)
    assert (list(w.kv._peers._entries.values()), list(w.kv._some_layers._entries.values())) == remembered


def test_the_table_moves_bytes_when_the_bad_part_is_taken_out() -> None:
    """The rows' valid part has work to do, so the snapshot check above can fail."""
    w = world()
    before = w.snapshot()
    receive(GOOD)(w)
    assert not w.same_as(before)


def test_numpy_integers_are_block_sizes_and_numpy_bools_are_not() -> None:
    # Plain ints take a fast path; numpy integers (read from a config array) are sizes
    # too, down to 1, and a numpy bool is refused as True is.
    caches = {"l": make_cache("KBNHC", "KBNHC", SIZES)}
    case = ReceiveCase(caches, "KBNHC", seed=8)
    case.send("a", [1, 2], "HNC", 4)
    case.send("b", [5], "HNC", 1)
    requests = {"a": [1, 2], "b": kvhost.Incoming([5], remote_block_size=np.int64(1))}
    stats = kvhost.receive(caches, requests, axes="KBNHC", remote_order="HNC", remote_block_size=np.int32(4))
    assert (stats.blocks, stats.groups, stats.skipped_blocks) == (3, 1, 1)  # 1-token blocks: the identity
    case.check()
    before = case.snapshot()
    with pytest.raises(kvhost.RequestError, match=r"remote_block_size must be a positive integer, got np\.True_"):
        kvhost.receive(caches, {"a": [1, 2]}, axes="KBNHC", remote_order="HNC", remote_block_size=np.bool_(True))
    assert case.same_as(before)


def test_a_plan_refused_for_one_layout_of_several_names_its_layer() -> None:
    """Layers may differ in strides; a sender's order that fits one layout and not another
    is refused naming a layer of the one it does not fit."""
    caches = {"a": make_cache("KBNHC", "KBNHC", SIZES), "b": make_cache("KBNHC", "BKNHC", SIZES)}
    for seed, tensor in enumerate(caches.values()):
        fill_random(tensor, seed)
    before = [raw(t).clone() for t in caches.values()]
    with pytest.raises(kvhost.RequestError, match=r"request 'r': layer 'b'\[0\]: remote order 'HNC' does not match"):
        kvhost.receive(caches, {"r": kvhost.Incoming([1, 2], "HNC", 4)}, axes="KBNHC")
    assert all(torch.equal(raw(t), saved) for t, saved in zip(caches.values(), before))
    caches["c"] = fill_random(make_cache("KBNHC", "BKNHC", SIZES), 2)  # a second layer of b's strides
    with pytest.raises(kvhost.RequestError, match=r"'r': layer 'b'\[0\] and 1 more of its strides: remote order 'HNC'"):
        kvhost.receive(caches, {"r": kvhost.Incoming([1, 2], "HNC", 4)}, axes="KBNHC")


class _LyingLength(list):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 1


def test_ids_are_counted_as_taken_not_as_their_len_says() -> None:
    """A list whose len() understates its ids: the request's count is what was read, so the
    duplicate past the claimed length is refused naming its request."""
    caches = {"l": make_cache("KBNHC", "KBNHC", SIZES)}
    with pytest.raises(kvhost.RequestError, match=r"block id 2 is claimed by request 'a' and request 'b'$"):
        kvhost.receive(
            caches, {"a": _LyingLength([1, 2]), "b": [2]}, axes="KBNHC", remote_order="HNC", remote_block_size=4
        )


def test_requests_in_any_mapping_are_received() -> None:
    # A dict takes a fast path; any other mapping (read-only, ordered) is requests too.
    from collections import OrderedDict
    from types import MappingProxyType

    caches = {"l": make_cache("KBNHC", "KBNHC", SIZES)}
    case = ReceiveCase(caches, "KBNHC", seed=9)
    case.send("a", [1, 2], "HNC", 4)
    case.send("b", [6], "HNC", 4)
    for requests in (MappingProxyType({"a": [1, 2]}), OrderedDict(b=[6])):
        stats = kvhost.receive(caches, requests, axes="KBNHC", remote_order="HNC", remote_block_size=4)
        assert stats.blocks == len(next(iter(requests.values())))
    case.check()


def test_a_cache_with_k_inside_its_block_region_is_not_copied_to_k_and_v_apart() -> None:
    """K and V as two tensors on one side means K is split off; where K lies inside the
    other side's block region (K and V interleaved per head) that cannot be, and the
    message says so, not what an internal view looked like."""
    sizes = dict(SIZES)
    src = {"l": make_cache("BNHKC", "BNHKC", sizes)}
    halves = {"l": tuple(make_cache("BNHC", "BNHC", sizes) for _ in range(2))}
    before = [raw(t).clone() for t in halves["l"]]
    with pytest.raises(kvhost.LayoutError, match="src: K lies inside the block region 'NHKC'"):
        kvhost.copy_blocks(src, halves, [1], [2], axes="BNHKC", dst_axes="BNHC")
    assert all(torch.equal(raw(t), b) for t, b in zip(halves["l"], before))
