"""Memory a call reads or writes is owned once, and registered caches stay what was registered.

kvhost's kernels write through raw addresses, so aliasing that torch would tolerate (two
names for one tensor, views that overlap) would make a call rewrite bytes twice or copy
in an order-dependent way. Each case here is refused before a byte moves, with the
overlap named; layouts whose memory interleaves without overlapping are accepted.
"""

from __future__ import annotations

import itertools
import sys
import threading

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvhost
from kvhost.errors import ArgumentError
from kvhost.lru import LRU
from kvhost.memory import Lane, find_overlap, first_shared
from kvhost.testing import ReceiveCase, fill_random, make_cache, raw

SIZES = dict(K=2, B=8, N=8, H=2, C=4)


def cache() -> torch.Tensor:
    return fill_random(make_cache("KBNHC", "KBNHC", SIZES), 1)


def receive(caches, axes="KBNHC"):
    return kvhost.receive(caches, {"r": [1, 2]}, axes=axes, remote_order="HNC", remote_block_size=4)


def unchanged(tensors, call):
    before = [raw(t).clone() for t in tensors]
    with pytest.raises(kvhost.KVHostError) as raised:
        call()
    assert all(torch.equal(raw(t), b) for t, b in zip(tensors, before)), "a refused call changed bytes"
    return str(raised.value)


# --- receive: every region of the caches is one tensor's alone ----------------------------


def test_two_layer_names_for_one_tensor():
    t = cache()
    message = unchanged([t], lambda: receive({"a": t, "b": t}))
    assert "layer 'a'[0][K=0] block 0 and layer 'b'[0][K=0] block 0 share memory" in message


def test_kv_tuple_of_one_tensor_twice():
    k = fill_random(make_cache("BNHC", "BNHC", SIZES), 2)
    message = unchanged([k], lambda: receive({"a": (k, k)}))
    assert "layer 'a'[0] block 0 and layer 'a'[1] block 0 share memory" in message


def test_two_tensors_over_one_buffer():
    memory = np.zeros(2 * 8 * 8 * 2 * 4, dtype=np.float32)
    a = torch.from_numpy(memory).view(2, 8, 8, 2, 4)
    b = torch.from_numpy(memory).view(2, 8, 8, 2, 4)  # another storage object, the same bytes
    assert a.untyped_storage() is not b.untyped_storage()
    message = unchanged([a], lambda: receive({"a": a, "b": b}))
    assert "share memory" in message


def test_views_that_overlap_in_part():
    memory = torch.zeros(3 * 8 * 8 * 2 * 4)
    a = memory[: 2 * 8 * 8 * 2 * 4].view(2, 8, 8, 2, 4)
    b = memory[8 * 8 * 2 * 4 :].view(2, 8, 8, 2, 4)  # starts at a's K=1
    message = unchanged([memory], lambda: receive({"a": a, "b": b}))
    assert "layer 'a'[0][K=1] block 0 and layer 'b'[0][K=0] block 0 share memory" in message


def test_a_tensor_whose_strides_make_its_own_blocks_overlap():
    region = 8 * 2 * 4
    memory = torch.zeros(20 * region)
    # K stride 4 regions, block stride 2: K=1 block 0 is K=0 block 2.
    t = memory.as_strided((2, 8, 8, 2, 4), (4 * region, 2 * region, 8, 4, 1))
    message = unchanged([memory], lambda: receive({"a": t}))
    assert "make two block regions share memory: region[K=0] block 2 and region[K=1] block 0" in message


def test_interleaved_layers_that_do_not_overlap_are_accepted():
    # One buffer, blocks outermost, every layer's K/V regions side by side within a block
    # (vLLM's cross-layer layouts): the layers' spans interleave, their regions do not.
    buffer = torch.zeros(8, 3, 2, 8, 2, 4, dtype=torch.bfloat16)  # B L K N H C
    layers = {f"l{i}": buffer[:, i].permute(1, 0, 2, 3, 4) for i in range(3)}  # K B N H C views
    case = ReceiveCase(layers, "KBNHC", seed=3)
    case.send("r", [1, 2], "KHNC", 4)  # K lies inside each block's region here
    kvhost.receive(layers, {"r": [1, 2]}, axes="KBNHC", remote_order="KHNC", remote_block_size=4)
    case.check()


def test_odd_strides_that_interleave_without_overlap_are_accepted():
    region = 8 * 2 * 4
    memory = torch.zeros(20 * region)
    # K stride 3 regions, block stride 2: K=0 at even regions, K=1 at odd ones from 3.
    t = memory.as_strided((2, 6, 8, 2, 4), (3 * region, 2 * region, 8, 4, 1))
    receive({"a": t})


# --- copies: no byte is both read and written ---------------------------------------------


def test_copy_between_crossed_layers_of_one_cache():
    caches = {"a": cache(), "b": fill_random(make_cache("KBNHC", "KBNHC", SIZES), 5)}
    crossed = {"a": caches["b"], "b": caches["a"]}
    message = unchanged(caches.values(), lambda: kvhost.copy_blocks(caches, crossed, [1], [1], axes="KBNHC"))
    assert "source layer 'a'[0][K=0] block 1 is destination layer 'b'[0][K=0] block 1" in message


def test_copy_between_two_tensors_over_one_buffer():
    memory = np.zeros(2 * 8 * 8 * 2 * 4, dtype=np.float32)
    src = {"a": torch.from_numpy(memory).view(2, 8, 8, 2, 4)}
    dst = {"a": torch.from_numpy(memory).view(2, 8, 8, 2, 4)}
    message = unchanged(dst.values(), lambda: kvhost.copy_blocks(src, dst, [1, 2], [2, 3], axes="KBNHC"))
    assert "source layer 'a'[0][K=0] block 2 is destination layer 'a'[0][K=0] block 2" in message


def test_copy_into_another_layout_of_the_same_memory():
    # dst reads the same bytes as HND: block 1 of dst is block 1 of src, whatever the order.
    src = {"a": cache()}
    dst = {"a": src["a"].view(2, 8, 2, 8, 4)}
    unchanged(src.values(), lambda: kvhost.copy_blocks(src, dst, [1], [1], axes="KBNHC", dst_axes="KBHNC"))


def test_copy_within_one_cache_between_disjoint_blocks_is_fine():
    caches = {"a": cache()}
    kvhost.copy_blocks(caches, caches, [1, 2], [5, 6], axes="KBNHC")
    assert torch.equal(raw(caches["a"][:, 5]), raw(caches["a"][:, 1]))


def test_copy_into_every_other_block_view_of_the_source():
    # dst is the odd blocks of the source's memory: src block 3 is dst block 1.
    memory = cache()
    src = {"a": memory[:, 0::2]}
    dst = {"a": memory[:, 1::2]}
    kvhost.copy_blocks(src, dst, [0, 1], [2, 3], axes="KBNHC")  # disjoint: even blocks into odd ones
    assert torch.equal(raw(memory[:, 5]), raw(memory[:, 0]))
    odd_as_source = {"a": memory[:, 1:]}  # block b is memory block b + 1
    message = unchanged([memory], lambda: kvhost.copy_blocks(odd_as_source, dst, [2], [1], axes="KBNHC"))
    assert "source layer 'a'[0][K=0] block 2 is destination layer 'a'[0][K=0] block 1" in message


# --- registered caches stay what was registered -------------------------------------------


def repointings():
    def set_elsewhere(t):
        t.set_(torch.zeros_like(t))

    def grow(t):
        t.resize_(2, 64, 8, 2, 4)

    def free(t):
        t.untyped_storage().resize_(0)

    def shrink(t):
        t.resize_(2, 4, 8, 2, 4)

    def restride(t):
        t.as_strided_((2, 8, 8, 2, 4), (8 * 8 * 2 * 4, 8 * 2 * 4, 2 * 4, 1, 2))

    return {"set_": set_elsewhere, "growing resize_": grow, "freed": free, "shrinking resize_": shrink,
            "as_strided_": restride}  # fmt: skip


@pytest.mark.parametrize("how", list(repointings()))
def test_a_registered_cache_that_changed_is_refused(how):
    caches = {"a": cache(), "b": cache()}
    host = kvhost.KVHost(caches, axes="KBNHC")
    peer = {"a": cache(), "b": cache()}
    repointings()[how](caches["b"])
    for call in (
        lambda: host.receive({"r": [1, 2]}, remote_order="HNC", remote_block_size=4),
        lambda: host.copy_to(peer, [1], [2]),
        lambda: host.copy_from(peer, [1], [2]),
    ):
        with pytest.raises(kvhost.LayoutError, match=r"layer 'b'\[0\] changed since it was registered"):
            call()
    # Registered again, the caches are read as they are now: usable, or refused for what they are.
    try:
        again = kvhost.KVHost(caches, axes="KBNHC")
    except kvhost.LayoutError as err:
        assert how in ("freed", "growing resize_", "shrinking resize_"), err
        assert "freed or shrunk" in str(err) or "all layers must match" in str(err)
    else:
        again.copy_to(peer, [1], [2])
        assert torch.equal(raw(peer["b"][:, 2]), raw(caches["b"][:, 1]))


def test_a_registered_cache_freed_and_made_again_smaller_at_its_address_is_refused():
    """Same address, shape and strides, a storage 4 KiB short: only its size tells. A receive
    would have written the last block into whatever the allocator put in the freed tail.

    Whether the allocator hands the freed memory's start back depends on its state: in a
    fresh process at once; after a whole suite, sometimes never (then the address tells,
    and ``test_the_in_place_check_compares_each_storages_size`` covers the size alone)."""
    for _ in range(50):
        cache = torch.zeros(2, 8, 16, 2, 64, dtype=torch.bfloat16)  # 64 KiB; K=1's block 7 is its last 4 KiB
        host = kvhost.KVHost({"a": cache}, axes="KBNHC")
        address, storage = cache.data_ptr(), cache.untyped_storage()
        storage.resize_(0)
        storage.resize_(60 << 10)
        if cache.data_ptr() == address:
            break
    told = r"storage bytes 65536 -> 61440" if cache.data_ptr() == address else r"address 0x"
    peer = {"a": torch.zeros(2, 8, 16, 2, 64, dtype=torch.bfloat16)}
    for call in (
        lambda: host.receive({"r": [7]}, remote_order="HNC", remote_block_size=16),
        lambda: host.copy_to(peer, [7], [7]),
        lambda: host.copy_from(peer, [7], [7]),
    ):
        with pytest.raises(kvhost.LayoutError, match=f"changed since .*{told}"):
            call()
    with pytest.raises(kvhost.LayoutError, match="its storage holds 61440 bytes but the tensor spans 65536"):
        kvhost.KVHost({"a": cache}, axes="KBNHC")
    # A peer remembered across calls is read again once its storage changed size.
    remembered = {"a": torch.zeros(2, 8, 16, 2, 64, dtype=torch.bfloat16)}
    other = kvhost.KVHost({"a": torch.zeros(2, 8, 16, 2, 64, dtype=torch.bfloat16)}, axes="KBNHC")
    other.copy_to(remembered, [1], [1])
    remembered["a"].untyped_storage().resize_(0)
    remembered["a"].untyped_storage().resize_(60 << 10)
    with pytest.raises(kvhost.LayoutError, match=r"dst: layer 'a'\[0\]: its storage holds 61440 bytes"):
        other.copy_to(remembered, [7], [7])


def test_the_in_place_check_compares_each_storages_size():
    """The size pass alone, whatever the allocator does: the tensor's address, shape and
    strides unchanged, its held storage half as large."""
    caches = {"a": cache(), "b": cache()}
    host = kvhost.KVHost(caches, axes="KBNHC")
    member = host.caches.layers["b"][0]
    shrunk = torch.UntypedStorage(member.storage_bytes // 2)  # stands for the held one, resized
    object.__setattr__(member, "storage", shrunk)
    assert not member.is_current()
    host.caches._storages = (host.caches._storages[0], shrunk)
    with pytest.raises(kvhost.LayoutError, match=r"layer 'b'\[0\] changed since .* storage bytes (\d+) -> \d+"):
        host.copy_to({"a": cache(), "b": cache()}, [1], [2])


def test_a_registered_cache_cut_to_fewer_blocks_in_place_is_refused():
    # Same address, same strides, half the blocks: only the shape tells it changed.
    caches = {"a": cache(), "b": cache()}
    host = kvhost.KVHost(caches, axes="KBNHC")
    caches["b"].as_strided_((2, 4, 8, 2, 4), caches["b"].stride())
    with pytest.raises(kvhost.LayoutError, match=r"layer 'b'\[0\] changed since it was registered .* shape"):
        host.copy_to({"a": cache(), "b": cache()}, [1], [2])


def test_a_peer_replaced_or_repointed_between_calls_is_read_again():
    caches = {"a": cache()}
    host = kvhost.KVHost(caches, axes="KBNHC")
    peer = {"a": torch.zeros_like(caches["a"])}
    host.copy_to(peer, [1], [2])
    assert torch.equal(raw(peer["a"][:, 2]), raw(caches["a"][:, 1]))
    peer["a"] = torch.zeros(2, 8, 8, 2, 4, dtype=torch.bfloat16)  # same mapping, another tensor
    host.copy_to(peer, [3], [4])
    assert torch.equal(raw(peer["a"][:, 4]), raw(caches["a"][:, 3]))
    peer["a"].set_(torch.zeros_like(peer["a"]))  # the same tensor, re-pointed
    host.copy_to(peer, [5], [6])
    assert torch.equal(raw(peer["a"][:, 6]), raw(caches["a"][:, 5]))


def test_a_peer_layer_list_whose_tensor_was_swapped_is_read_again():
    """A peer known by identity (the same layer objects) is only checked for moves; a layer
    given as a list can change inside while staying the same object, so it is read again."""
    caches = {"a": cache()}
    host = kvhost.KVHost(caches, axes="KBNHC")
    k, v = (torch.zeros(8, 8, 2, 4, dtype=torch.bfloat16) for _ in range(2))
    layer = [k, v]
    peer = {"a": layer}
    host.copy_to(peer, [1], [2])
    assert torch.equal(raw(layer[1][2]), raw(caches["a"][1, 1]))
    layer[1] = torch.zeros(8, 8, 2, 4, dtype=torch.bfloat16)  # same list, another V
    host.copy_to(peer, [3], [4])
    assert torch.equal(raw(layer[1][4]), raw(caches["a"][1, 3]))
    pair = (k, layer[1])
    peer = {"a": pair}
    host.copy_to(peer, [5], [6])
    pair[0].set_(torch.zeros_like(pair[0]))  # the same tuple, its K re-pointed
    host.copy_to(peer, [6], [7])
    assert torch.equal(raw(pair[0][7]), raw(caches["a"][0, 6]))


# --- threads: disjoint blocks, more peers than the caches hold ------------------------------


def test_threads_with_many_peers_never_collide():
    """Peers and copy plans are remembered in small caches: their evictions race when
    threads bring more peers than they hold (a thread switch every microsecond makes the
    race likely)."""
    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    caches = {f"l{i}": fill_random(make_cache("KBNHC", "KBNHC", SIZES), 1 + i) for i in range(2)}
    before = {name: raw(t).clone() for name, t in caches.items()}
    host = kvhost.KVHost(caches, axes="KBNHC")
    peers = [{name: torch.zeros_like(t) for name, t in caches.items()} for _ in range(16)]  # the caches keep 4
    threads_count = 6
    errors: list[BaseException] = []
    barrier = threading.Barrier(threads_count)

    def work(thread: int) -> None:
        try:
            barrier.wait()
            for round_ in range(200):
                peer = peers[(thread * 5 + round_) % len(peers)]
                host.copy_to(peer, [thread], [thread])
                host.copy_from(peer, [thread], [thread])
        except BaseException as err:
            errors.append(err)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(threads_count)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(old_interval)
    assert errors == []
    # Each thread went round every peer: each holds every thread's block, copied and back
    # unchanged, and no other block (a copy dropped, or landed in another's block, shows).
    blocks = list(range(threads_count))
    assert all(torch.equal(raw(caches[name]), before[name]) for name in caches)
    for peer, name in itertools.product(peers, caches):
        assert torch.equal(raw(peer[name][:, blocks]), before[name][:, blocks])
        assert not raw(peer[name][:, threads_count:]).any()


# --- the overlap arithmetic against listing every block -------------------------------------


def listed(lanes: list[Lane]) -> bool:
    spans = sorted(
        (lane.start + b * lane.stride, lane.start + b * lane.stride + lane.length)
        for lane in lanes
        for b in range(lane.count)
    )
    return any(start < end for (_, end), (start, _) in itertools.pairwise(spans))


def lane(start: int, stride: int, count: int, length: int) -> Lane:
    """A lane as a layout makes one: its own blocks never overlap (stride at least the length)."""
    return Lane(start, max(stride, length), count, length, owner="x")


lanes_strategy = st.lists(
    st.builds(lane, st.integers(0, 200), st.integers(1, 40), st.integers(1, 12), st.integers(1, 16)),
    min_size=1,
    max_size=5,
)


@settings(max_examples=600, deadline=None)
@given(lanes_strategy)
def test_find_overlap_agrees_with_listing_every_block(lanes):
    found = find_overlap(lanes)
    assert (found is not None) == listed(lanes)
    if found is not None:
        a = found.first.start + found.first_block * found.first.stride
        b = found.second.start + found.second_block * found.second.stride
        assert a < b + found.second.length and b < a + found.first.length
        assert found.first_block < found.first.count and found.second_block < found.second.count


@settings(max_examples=300, deadline=None)
@given(lanes_strategy, st.data())
def test_first_shared_agrees_with_listing_the_named_blocks(lanes, data):
    x, y = lanes[0], lanes[-1]
    xs = np.array(data.draw(st.lists(st.integers(0, x.count - 1), max_size=6)), dtype=np.int64)
    ys = np.array(data.draw(st.lists(st.integers(0, y.count - 1), max_size=6)), dtype=np.int64)
    found = first_shared(x, xs, y, ys)
    brute = any(
        x.start + i * x.stride < y.start + j * y.stride + y.length
        and y.start + j * y.stride < x.start + i * x.stride + x.length
        for i in xs.tolist()
        for j in ys.tolist()
    )
    assert (found is not None) == brute


def test_lru_keeps_its_bound_and_survives_threads():
    cache: LRU[int, int] = LRU(4)
    for key in range(6):
        cache.put(key, key)
    assert len(cache) == 4 and cache.get(0) is None and cache.get(5) == 5
    cache.get(2)  # refreshed: the oldest is now 3
    cache.put(6, 6)
    assert cache.get(3) is None and cache.get(2) == 2
    errors: list[BaseException] = []

    def hammer(offset: int) -> None:
        try:
            for key in range(5000):
                slot = (key + offset) % 9
                found = cache.get(slot)
                if found is None:
                    cache.put(slot, slot)
                elif found != slot:
                    raise AssertionError(f"slot {slot} holds {found}")
        except BaseException as err:
            errors.append(err)

    threads = [threading.Thread(target=hammer, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(cache) <= 4


def test_lru_refuses_no_room_and_a_put_refreshes_its_entry():
    for size in (0, -1):
        with pytest.raises(ArgumentError, match=f"room for at least one entry, got {size}"):
            LRU(size)
    one: LRU[str, int] = LRU(1)
    one.put("a", 1)
    one.put("b", 2)
    assert len(one) == 1 and one.get("a") is None and one.get("b") == 2
    cache: LRU[str, int] = LRU(2)
    assert cache.put("x", 10) == 10 and cache.get("x") == 10
    cache.put("y", 20)
    cache.put("x", 30)  # a put refreshes: x is now the newest, so y goes next
    cache.put("z", 40)
    assert cache.get("y") is None and cache.get("x") == 30 and cache.get("z") == 40
    cache.clear()
    assert len(cache) == 0 and cache.get("x") is None
