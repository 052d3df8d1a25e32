"""Bad input: a KVHostError subclass naming the value at fault, and not one byte changed.

Every receive case puts valid requests beside the bad one, so a front end that moved
bytes before validating the whole batch would be caught by the snapshot.
"""

from __future__ import annotations

import pytest
import torch

import kvhost
from kvhost.testing import ReceiveCase, fill_random, make_cache, raw

SIZES = dict(K=2, B=8, N=8, H=2, C=4)


def hnd_caches(device: str = "cpu", layers: int = 2) -> dict[str, torch.Tensor]:
    return {f"layer{i}": make_cache("KBNHC", "KBNHC", SIZES, device=device) for i in range(layers)}


def wired_case(target) -> tuple[dict[str, torch.Tensor], ReceiveCase]:
    caches = hnd_caches(target.device)
    case = ReceiveCase(caches, "KBNHC", seed=1)
    case.send("good", [1, 2], "HNC", 4)
    return caches, case


RECEIVE_ERRORS = {
    "out of range": ({"bad": [3, 8]}, {}, kvhost.RequestError, ["'bad'", "block id 8", "[0, 8)"]),
    "negative": ({"bad": [-1]}, {}, kvhost.RequestError, ["'bad'", "-1"]),
    "claimed twice": ({"other": [2, 5]}, {}, kvhost.RequestError, ["block id 2", "'good'", "'other'"]),
    "twice in one request": ({"bad": [5, 5]}, {}, kvhost.RequestError, ["'bad'", "block id 5", "twice"]),
    "sizes do not divide": ({"bad": kvhost.Incoming([5], "HNC", 3)}, {}, kvhost.RequestError, ["'bad'", "3", "8"]),
    "partial group": (
        {"bad": kvhost.Incoming([4, 5, 6], "HNC", 16)},
        {},
        kvhost.RequestError,
        ["'bad'", "3 block ids", "groups of 2"],
    ),
    "letters": ({"bad": kvhost.Incoming([5], "HDC", 4)}, {}, kvhost.RequestError, ["'bad'", "HDC", "'D'"]),
    "letters not the region": (
        {"bad": kvhost.Incoming([5], "KNC", 4)},
        {},
        kvhost.RequestError,
        ["'bad'", "KNC", "NHC"],
    ),
    "zero block size": ({"bad": kvhost.Incoming([5], "HNC", -4)}, {}, kvhost.RequestError, ["'bad'", "-4"]),
    "not integers": ({"bad": [1.5]}, {}, kvhost.RequestError, ["'bad'", "integers"]),
}


@pytest.mark.parametrize("name", list(RECEIVE_ERRORS))
def test_receive_rejects_bad_batch_and_changes_nothing(target, name):
    extra, kwargs, error, words = RECEIVE_ERRORS[name]
    caches, case = wired_case(target)
    before = case.snapshot()
    requests = {"good": [1, 2], **extra}
    with pytest.raises(error) as raised:
        kvhost.receive(
            caches, requests, axes="KBNHC", remote_order="HNC", remote_block_size=4, backend=target.backend, **kwargs
        )
    assert isinstance(raised.value, kvhost.KVHostError)
    for word in words:
        assert word in str(raised.value), f"{word!r} not in {raised.value}"
    assert case.same_as(before)


def test_layers_of_different_shapes():
    caches = hnd_caches()
    caches["odd"] = make_cache("KBNHC", "KBNHC", dict(SIZES, H=4))
    with pytest.raises(kvhost.LayoutError, match=r"'odd'.*all layers must match$"):
        kvhost.receive(caches, {"r": [1]}, axes="KBNHC", remote_order="HNC", remote_block_size=4)
    # K and V of one layer with two head dims: the message says how such a layer is passed.
    split = {"l": tuple(make_cache("BNHC", "BNHC", dict(B=8, N=16, H=2, C=c)) for c in (8, 4))}
    with pytest.raises(kvhost.LayoutError, match=r"'l'\[1\].*all layers must match; .*two head dims\) go in two calls"):
        kvhost.receive(split, {"r": [1]}, axes="KBNHC", remote_order="HNC", remote_block_size=4)


def test_layers_on_different_devices_or_dtypes():
    caches = hnd_caches()
    caches["wide"] = make_cache("KBNHC", "KBNHC", SIZES, dtype=torch.float32)
    with pytest.raises(kvhost.LayoutError, match=r"'wide'.*float32"):
        kvhost.receive(caches, {"r": [1]}, axes="KBNHC", remote_order="HNC", remote_block_size=4)
    if torch.cuda.is_available():
        caches = hnd_caches()
        caches["gpu"] = make_cache("KBNHC", "KBNHC", SIZES, device="cuda")
        with pytest.raises(kvhost.LayoutError, match=r"'gpu'.*one device"):
            kvhost.receive(caches, {"r": [1]}, axes="KBNHC")


@pytest.mark.parametrize(
    ("axes", "shape", "words"),
    [
        ("KBNHQ", (2, 8, 8, 2, 4), ["unknown", "'Q'"]),
        ("KBNNC", (2, 8, 8, 2, 4), ["repeats", "'N'"]),
        ("KBHC", (2, 8, 2, 4), ["lack", "'N'"]),
        ("KBNC", (2, 8, 8, 2, 4), ["4 dims", "has 5"]),
    ],
)
def test_bad_axes(axes, shape, words):
    with pytest.raises(kvhost.LayoutError) as raised:
        kvhost.receive({"l": torch.zeros(shape)}, {"r": [1]}, axes=axes)
    for word in words:
        assert word in str(raised.value)


def test_region_not_contiguous():
    # Every other channel: the region has holes.
    holey = torch.zeros(2, 8, 8, 2, 8)[..., ::2]
    with pytest.raises(kvhost.LayoutError, match=r"not contiguous.*axis C") as refused:
        kvhost.receive({"l": holey}, {"r": [1]}, axes="KBNHC")
    assert "one token" not in str(refused.value)  # holes in a token's channels: no blocks of one token mend them
    assert "inside it" not in str(refused.value)  # nothing lies inside C
    # Tokens apart from one another (a host buffer [2, tokens, L, H, C] seen layer by layer):
    # the message says how such memory is described.
    page_first = {"l0": torch.zeros(2, 8 * 16, 4, 2, 8)[:, :, 0].unflatten(1, (8, 16))}
    with pytest.raises(kvhost.LayoutError, match=r"axis N has stride 64.*blocks of one token: N of 1, an id per token"):
        kvhost.receive(page_first, {"r": [1]}, axes="KBNHC")
    one_head = {"l0": torch.zeros(2, 8 * 16, 4, 1, 8)[:, :, 0].unflatten(1, (8, 16))}  # a head of one: not named
    with pytest.raises(kvhost.LayoutError, match=r"axis N has stride 32, .*; C inside it fill 8 of those 32 elements"):
        kvhost.receive(one_head, {"r": [1]}, axes="KBNHC", remote_order="NHC", remote_block_size=32)
    # A rank's share of heads sliced off a larger cache: what lies between is said.
    share = torch.zeros(2, 8, 8, 3, 8)[:, :, :, :2]
    with pytest.raises(
        kvhost.LayoutError,
        match=r"axis N has stride 24, a dense region needs 16 .*; H, C inside it "
        r"fill 16 of those 24 elements: other data lies between .*heads of another rank sliced off",
    ):
        kvhost.receive({"l": share}, {"r": [1]}, axes="KBNHC", remote_order="HNC", remote_block_size=8)
    # Tokens outside the block region: N before B in memory.
    n_outer = torch.zeros(8, 2, 8, 2, 4).permute(1, 2, 0, 3, 4)
    with pytest.raises(kvhost.LayoutError, match=r"tokens"):
        kvhost.receive({"l": n_outer}, {"r": [1]}, axes="KBNHC")
    # Broadcast views alias memory.
    aliased = torch.zeros(2, 1, 8, 2, 4).expand(2, 8, 8, 2, 4)
    with pytest.raises(kvhost.LayoutError, match=r"overlap"):
        kvhost.receive({"l": aliased}, {"r": [1]}, axes="KBNHC")


def copy_pair(target):
    src = hnd_caches("cpu")
    dst = hnd_caches(target.device)
    for i, t in enumerate([*src.values(), *dst.values()]):
        fill_random(t, i)
    return src, dst, [raw(t).cpu().clone() for t in dst.values()]


COPY_ERRORS = {
    "lengths differ": ([1, 2, 3], [1, 2], kvhost.RequestError, ["3 ids", "2"]),
    "duplicate destination": ([1, 2], [4, 4], kvhost.RequestError, ["dst_ids", "block id 4", "twice"]),
    "source out of range": ([1, 9], [1, 2], kvhost.RequestError, ["src_ids", "9", "[0, 8)"]),
    "destination negative": ([1, 2], [0, -3], kvhost.RequestError, ["dst_ids", "-3"]),
}


@pytest.mark.parametrize("name", list(COPY_ERRORS))
def test_copy_rejects_bad_ids_and_changes_nothing(target, name):
    src_ids, dst_ids, error, words = COPY_ERRORS[name]
    src, dst, before = copy_pair(target)
    with pytest.raises(error) as raised:
        kvhost.copy_blocks(src, dst, src_ids, dst_ids, axes="KBNHC", backend=target.backend)
    for word in words:
        assert word in str(raised.value), f"{word!r} not in {raised.value}"
    assert all(torch.equal(raw(t).cpu(), saved) for t, saved in zip(dst.values(), before))


def test_copy_layer_names_must_match():
    src, dst, _ = copy_pair(type("T", (), {"device": "cpu"}))
    dst["extra"] = dst.pop("layer1")
    with pytest.raises(kvhost.LayoutError, match=r"only in src \['layer1'\], only in dst \['extra'\]"):
        kvhost.copy_blocks(src, dst, [1], [1], axes="KBNHC")


def test_copy_letters_and_dtypes_must_match():
    src = hnd_caches()
    other_heads = {name: make_cache("KBNHC", "KBNHC", dict(SIZES, H=4)) for name in src}
    with pytest.raises(kvhost.LayoutError, match=r"'layer0'.*do not match"):
        kvhost.copy_blocks(src, other_heads, [1], [1], axes="KBNHC")
    halves = {name: make_cache("KBNHC", "KBNHC", SIZES, dtype=torch.float16) for name in src}
    with pytest.raises(kvhost.LayoutError, match=r"bfloat16.*float16"):
        kvhost.copy_blocks(src, halves, [1], [1], axes="KBNHC")


def test_copy_within_one_cache_must_not_overlap():
    caches = hnd_caches()
    with pytest.raises(kvhost.RequestError, match=r"both read and write.*'layer0'.*block 3 is destination.*block 3"):
        kvhost.copy_blocks(caches, caches, [1, 3], [3, 4], axes="KBNHC")
    # Disjoint blocks of the same cache are fine (e.g. a block move within the device).
    fill_random(caches["layer0"], 7)
    kvhost.copy_blocks(caches, caches, [1, 2], [5, 6], axes="KBNHC")
    assert torch.equal(raw(caches["layer0"][:, 5]), raw(caches["layer0"][:, 1]))


def test_backend_errors():
    with pytest.raises(kvhost.BackendError, match=r"'nonesuch'.*registered"):
        kvhost.receive(hnd_caches(), {"r": [1]}, axes="KBNHC", backend="nonesuch")


def test_first_line_is_an_exceptions_first_line_or_nothing():
    from kvhost.errors import first_line

    class Unreadable(Exception):
        def __str__(self):
            raise ValueError("no")

    assert first_line(RuntimeError("  out of memory\nTried to allocate 2 MiB\n")) == "out of memory"
    assert first_line(MemoryError()) == "" and first_line(RuntimeError("\n \n")) == ""
    assert first_line(Unreadable()) == "(its message could not be read)"


class _Unprintable:
    """A value whose repr raises, as a caller's odd object may."""

    def __repr__(self) -> str:
        raise RuntimeError("no repr")


def test_a_value_whose_repr_raises_is_named_by_its_type_in_a_kvhost_error():
    """Messages show a caller's value through ``shown``: a repr that raises once escaped as
    that RuntimeError from inside the message, in place of the refusal."""
    odd = _Unprintable()
    cache = {"l": make_cache("KBNHC", "KBNHC", dict(K=2, B=8, N=4, H=2, C=4))}
    host = kvhost.KVHost(cache, axes="KBNHC")
    calls = [
        (lambda: host.receive({"r": [1]}, remote_order="HNC", remote_block_size=2, layers=odd), "got a _Unprintable"),
        (lambda: host.receive({"r": [1]}, remote_order="HNC", remote_block_size=2, layers=[odd]), "a _Unprintable"),
        (lambda: host.copy_to(cache, [1], [2], non_blocking=odd), "got a _Unprintable"),
        (lambda: kvhost.receive(cache, {"r": [1]}, axes="KBNHC", backend=odd), "got a _Unprintable"),
        (lambda: kvhost.receive(cache, {"r": kvhost.Incoming([1], "HNC", 2, tokens=odd)}, axes="KBNHC"), "a _Un"),
        (lambda: kvhost.receive(cache, {"r": [1]}, axes="KBNHC", remote_order="HNC", remote_block_size=odd), "a _Un"),
        (lambda: kvhost.receive(cache, {"r": [1, odd]}, axes="KBNHC", remote_order="HNC", remote_block_size=2), "_Un"),
        (lambda: kvhost.get_backend(odd), "a _Unprintable"),
        (lambda: kvhost.get_backend("cpu", odd), "a _Unprintable"),
    ]
    for call, said in calls:
        with pytest.raises(kvhost.KVHostError, match=said):
            call()
