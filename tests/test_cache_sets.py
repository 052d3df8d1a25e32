"""A layer dict read into a CacheSet: what is checked, what is remembered, and when it is read again.

Pins the rules of kvhost/caches.py where the conformance suite does not reach them: a
dict of two layers (the second is checked against the first), tensors with no host
address (meta here, XLA on a TPU host), storages one item short of a view at an offset,
copies whose overlapping tensors start in either order, and the promise that a peer or a
copy plan is read once while nothing changed and read again when something did. Found by
mutation testing (ci/mutation.py).
"""

from __future__ import annotations

import pytest
import torch

import kvhost
from kvhost.caches import CacheSet, Member
from kvhost.layout import Layout
from kvhost.testing import fill_random, make_cache, raw

SIZES = dict(K=2, B=8, N=8, H=2, C=4)


def cache(seed: int = 1, device: str = "cpu") -> torch.Tensor:
    t = make_cache("KBNHC", "KBNHC", SIZES, device=device)
    return t if device == "meta" else fill_random(t, seed)


def empty() -> torch.Tensor:
    return torch.zeros(2, 8, 8, 2, 4, dtype=torch.bfloat16)


# --- what a set must be ---------------------------------------------------------------------


def test_no_layers_is_refused():
    with pytest.raises(kvhost.LayoutError, match="caches: no layers given"):
        CacheSet({}, "KBNHC")


@pytest.mark.parametrize("odd", ["shape", "dtype"])
def test_the_second_of_two_layers_is_checked_against_the_first(odd):
    other = make_cache("KBNHC", "KBNHC", dict(SIZES, H=4)) if odd == "shape" else cache().float()
    with pytest.raises(kvhost.LayoutError, match=r"layer 'b'\[0\] has .* but layer 'a'\[0\] has"):
        CacheSet({"a": cache(), "b": other}, "KBNHC")


def test_the_two_tensors_of_one_layer_are_named_apart_when_they_differ():
    """K and V kept apart in one layer: the message says which member differs, not the
    layer's name twice."""
    k, v = cache()[0], make_cache("KBNHC", "KBNHC", dict(SIZES, H=4))[0]
    with pytest.raises(kvhost.LayoutError, match=r"caches: layer 'a'\[1\] has shape .* but layer 'a'\[0\] has"):
        CacheSet({"a": (k, v)}, "KBNHC")


def test_one_set_lives_on_one_device():
    with pytest.raises(kvhost.LayoutError, match="layer 'b' is on meta but layer 'a' is on cpu; one call serves one"):
        CacheSet({"a": cache(), "b": cache(device="meta")}, "KBNHC")


def test_a_view_at_an_offset_whose_storage_is_one_item_short_is_refused():
    buffer = torch.zeros(3, 2, 4, 8, 3, dtype=torch.bfloat16)
    view = buffer[1]  # 192 items in, spanning 384 bytes: storage must hold 768
    kvhost.KVHost({"l": view}, axes="KBNC")
    view.untyped_storage().resize_(766)
    with pytest.raises(kvhost.LayoutError, match=r"holds 766 bytes but the tensor spans 768: freed or shrunk"):
        kvhost.KVHost({"l": view}, axes="KBNC")


def test_a_tuple_whose_second_tensor_was_shrunk_is_refused_naming_it():
    k, v = torch.zeros(8, 4, 2, 8, dtype=torch.bfloat16), torch.zeros(8, 4, 2, 8, dtype=torch.bfloat16)
    v.untyped_storage().resize_(v.untyped_storage().nbytes() - 2)
    with pytest.raises(kvhost.LayoutError, match=r"layer 'l'\[1\]: its storage holds 1022 bytes .*: freed or shrunk"):
        CacheSet({"l": (k, v)}, "KBNHC")


def test_layers_of_one_layout_but_for_their_block_count_are_refused():
    # The same strides, another number of blocks: the layout read for the layer before does
    # not describe it, and the set refuses it as any other shape that differs.
    whole = cache()
    with pytest.raises(kvhost.LayoutError, match=r"layer 'b'\[0\] has shape \(2, 6, .*all layers must match"):
        CacheSet({"a": whole, "b": cache(seed=2)[:, :6]}, "KBNHC")


# --- tensors without a host address ---------------------------------------------------------


class _NoAddress:
    """A storage that, like XLA's, refuses to give an address."""

    def data_ptr(self) -> int:
        raise RuntimeError("this storage has no address")

    def nbytes(self) -> int:
        return 4096


class _XlaLike:
    def untyped_storage(self) -> _NoAddress:
        return _NoAddress()

    def data_ptr(self) -> int:
        return 0x1000  # torch reports one, but it is no host memory


def test_a_storage_with_no_address_makes_a_member_with_address_0():
    layout = Layout.of(cache(), "KBNHC")
    member = Member("l", 0, _XlaLike(), layout)  # type: ignore[arg-type]
    assert (member.address, member.data_ptr, member.storage_bytes) == (0, 0x1000, 4096)


def test_a_tuples_index_stands_for_k_where_the_axes_name_a_k_its_tensors_lack():
    pair = tuple(cache().unbind(0))  # K and V apart: [B, N, H, C] each
    assert CacheSet({"l": pair}, "KBNHC").tuple_is_k
    assert CacheSet({"l": pair}, "KBNHC").member_axes == "BNHC"
    assert not CacheSet({"l": cache()}, "KBNHC").tuple_is_k  # K is a dim of the tensor
    assert not CacheSet({"l": (cache(),)}, "KBNHC").tuple_is_k  # a tuple of one tensor that has its K
    assert not CacheSet({"l": pair}, "BNHC").tuple_is_k  # no K named: the tuple's index is no letter


def test_tensors_without_addresses_are_told_apart_by_identity():
    a, b = cache(device="meta"), cache(device="meta")
    assert [m.address for m in CacheSet({"a": a, "b": b}, "KBNHC").members] == [0, 0]
    with pytest.raises(kvhost.LayoutError, match=r"layer 'a'\[0\] and layer 'b'\[0\] are one tensor"):
        CacheSet({"a": a, "b": a}, "KBNHC")
    assert kvhost.copy_blocks({"l": a}, {"l": b}, [1, 2], [1, 2], axes="KBNHC").blocks == 2
    with pytest.raises(kvhost.RequestError, match="both read and write"):
        kvhost.copy_blocks({"l": a}, {"l": a}, [1, 2], [2, 3], axes="KBNHC")


def test_tensors_without_addresses_may_not_be_views_of_one_buffer():
    """Without addresses (meta, XLA) views report no storage offset that can be trusted, so
    K and V unbound from one tensor cannot be told from one view given twice: both refused."""
    a = cache(device="meta")
    for layers in ({"a": a, "b": a.view(a.shape)}, {"a": tuple(a.unbind(0))}, {"a": (a[0],), "b": (a[1],)}):
        with pytest.raises(kvhost.LayoutError, match=r"are views of one buffer, and on meta kvhost cannot tell"):
            CacheSet(layers, "KBNHC")
    # kvhost's own split of a checked set is still made (K inside the tensor on one side).
    pair = (cache(device="meta")[0], cache(device="meta")[0])
    assert kvhost.copy_blocks({"l": a}, {"l": pair}, [1, 2], [3, 4], axes="KBNHC").blocks == 2


# --- copies whose tensors share a buffer ----------------------------------------------------


@pytest.mark.parametrize("first", ["source", "destination"])
def test_a_read_and_a_write_of_one_buffer_are_found_whichever_starts_first(first):
    # Layer a reads from a buffer that layer b writes: a's source and b's destination are
    # views of one buffer, two blocks apart; the other two tensors are their own.
    buffer = fill_random(torch.zeros(12, 8, 2, 4, dtype=torch.bfloat16), 3)
    early, late = buffer[0:8], buffer[2:10]
    source_view, dest_view = (early, late) if first == "source" else (late, early)
    src = {"a": source_view, "b": fill_random(torch.zeros(8, 8, 2, 4, dtype=torch.bfloat16), 4)}
    dst = {"a": torch.zeros(8, 8, 2, 4, dtype=torch.bfloat16), "b": dest_view}
    src_id, dst_id = (2, 0) if first == "source" else (0, 2)  # both are buffer block 2
    before = raw(buffer).clone()
    with pytest.raises(kvhost.RequestError) as raised:
        kvhost.copy_blocks(src, dst, [src_id], [dst_id], axes="BNHC")
    assert f"source layer 'a'[0] block {src_id} is destination layer 'b'[0] block {dst_id}" in str(raised.value)
    assert torch.equal(raw(buffer), before)


# --- read once, read again when changed -----------------------------------------------------


def test_a_peer_is_read_once_while_it_holds_the_same_tensors():
    host = kvhost.KVHost({"a": cache(), "b": cache(2)}, axes="KBNHC")

    def read(peer):
        """The set a copy to ``peer`` used, as the registered object keeps it."""
        host.copy_to(peer, [1], [1])
        return host._peers.get((id(peer), "KBNHC", "dst"))

    peer = {"a": empty(), "b": empty()}
    first = read(peer)
    assert first is not None and read(peer) is first
    pairs = {"a": tuple(cache(3).unbind(0)), "b": tuple(cache(4).unbind(0))}  # K and V apart
    first_pairs = read(pairs)
    assert first_pairs is not None and read(pairs) is first_pairs
    peer["b"] = empty()  # another tensor under the same name
    assert read(peer) is not first
    pairs["a"] = pairs["a"][:1]  # one tensor fewer
    with pytest.raises(kvhost.LayoutError):
        host.copy_to(pairs, [1], [1])
    assert host._peers.get((id(pairs), "KBNHC", "dst")) is first_pairs  # refused: kept as it was


def test_a_peer_whose_tensors_changed_names_gets_each_layer_under_its_new_name():
    """The same dict, re-keyed: its tensors in the same order, each under the other's name.
    The set read before no longer describes it, and layer 'a' lands in what 'a' names now."""
    host = kvhost.KVHost({"a": cache(), "b": cache(2)}, axes="KBNHC")
    first, second = empty(), empty()
    peer = {"a": first, "b": second}
    host.copy_to(peer, [1], [1])
    peer.clear()
    peer["b"], peer["a"] = first, second  # the values' order kept, their names swapped
    host.copy_to(peer, [2], [2])
    assert torch.equal(raw(second[:, 2]), raw(host.caches.layers["a"][0].tensor[:, 2]))
    assert torch.equal(raw(first[:, 2]), raw(host.caches.layers["b"][0].tensor[:, 2]))


def test_a_peer_that_lost_a_layer_is_refused():
    caches = {"a": cache(), "b": cache(2)}
    host = kvhost.KVHost(caches, axes="KBNHC")
    peer = {"a": empty(), "b": empty()}
    host.copy_to(peer, [1], [1])
    dropped = peer.pop("b")
    with pytest.raises(kvhost.LayoutError, match=r"layer names differ: only in src \['b'\], only in dst \[\]"):
        host.copy_to(peer, [2], [2])
    assert not raw(dropped[:, 2]).any(), "a layer no longer in the peer was written"
    peer["b"], peer["c"] = dropped, torch.zeros_like(dropped)
    with pytest.raises(kvhost.LayoutError, match=r"only in dst \['c'\]"):
        host.copy_to(peer, [2], [2])


def test_copy_groups_and_layout_groups_are_worked_out_once():
    src = CacheSet({"a": cache(), "b": cache(2)}, "KBNHC")
    dst = CacheSet({"a": cache(3), "b": cache(4)}, "KBNHC")
    assert src.copy_groups(dst) is src.copy_groups(dst)
    other = CacheSet({"a": cache(5), "b": cache(6)}, "KBNHC")
    assert src.copy_groups(other) is not src.copy_groups(dst)
    assert src.by_layout() is src.by_layout()


def test_receive_groups_are_planned_once_per_transform_and_a_few_are_kept():
    from kvhost.transform import plan_receive

    token_major, head_major = cache(), make_cache("KBNHC", "KBHNC", SIZES)
    cache_set = CacheSet({"a": token_major, "b": head_major, "c": cache(3)}, "KBNHC")
    groups = cache_set.receive_groups("HNC", 4)
    assert cache_set.receive_groups("HNC", 4) is groups
    # One group per layout with work, in first-seen order, with that layout's plan.
    assert [[m.tensor for m in g.members] for g in groups] == [[token_major, cache_set.members[2].tensor], [head_major]]
    assert [g.rearrangement for g in groups] == [plan_receive(g.layout, "HNC", 4) for g in groups]
    # Head-major senders of 8-token blocks leave the head-major layer as it is.
    (only,) = cache_set.receive_groups("HNC", 8)
    assert [m.tensor for m in only.members] == [token_major, cache_set.members[2].tensor]
    assert CacheSet({"a": cache()}, "KBNHC").receive_groups("NHC", 8) == ()  # the identity everywhere
    with pytest.raises(kvhost.KVHostError, match=r"block sizes 8 \(local\) and 3 \(remote\)"):
        cache_set.receive_groups("HNC", 3)
    # A peer may name many transforms: 16 are kept, the least recently used goes first.
    transforms = [(order, size) for order in ("HNC", "NHC", "HCN", "CNH") for size in (1, 2, 4, 8, 16)]
    kept = [cache_set.receive_groups(*t) for t in transforms[:16]]
    assert all(cache_set.receive_groups(*t) is g for t, g in zip(transforms[:16], kept))
    cache_set.receive_groups(*transforms[16])
    assert cache_set.receive_groups(*transforms[0]) is not kept[0]
    assert cache_set.receive_groups(*transforms[2]) is kept[2]


# --- dtypes and tuples ----------------------------------------------------------------------


def test_bytes_stand_in_for_a_dtype_of_their_size_and_no_other():
    fp8 = {"l": fill_random(make_cache("KBNHC", "KBNHC", SIZES, torch.float8_e4m3fn), 1)}
    host = {"l": torch.zeros(2, 8, 8, 2, 4, dtype=torch.uint8)}
    kvhost.copy_blocks(fp8, host, [1], [2], axes="KBNHC")
    assert torch.equal(host["l"][:, 2], fp8["l"][:, 1].view(torch.uint8))
    back = {"l": torch.zeros_like(fp8["l"])}
    kvhost.copy_blocks(host, back, [2], [3], axes="KBNHC")
    assert torch.equal(back["l"][:, 3].view(torch.uint8), fp8["l"][:, 1].view(torch.uint8))
    wide = {"l": torch.zeros(2, 8, 8, 2, 4, dtype=torch.int16)}
    with pytest.raises(kvhost.LayoutError, match=r"'l': source dtype torch.uint8 != destination dtype torch.int16"):
        kvhost.copy_blocks(host, wide, [2], [3], axes="KBNHC")
    flags = {"l": torch.zeros(2, 8, 8, 2, 4, dtype=torch.bool)}  # a bool's byte is 0 or 1: no raw bytes into it
    for source in (host, {"l": host["l"].view(torch.int8)}):
        with pytest.raises(kvhost.LayoutError, match=r"'l': source dtype torch.u?int8 != destination dtype torch.bool"):
            kvhost.copy_blocks(source, flags, [2], [3], axes="KBNHC")
    assert not flags["l"].any()
    kvhost.copy_blocks(flags, host, [3], [2], axes="KBNHC")  # out of a bool, its bytes are bytes
    assert not host["l"][:, 2].any()


def test_a_tuple_of_tensors_that_each_have_every_letter_is_a_layer_of_several_members():
    first, second = cache(1), cache(2)
    cache_set = CacheSet({"l": (first, second)}, "KBNHC")
    assert cache_set.member_axes == "KBNHC"
    assert [m.tensor is t for m, t in zip(cache_set.members, (first, second))] == [True, True]
    k_and_v = CacheSet({"l": tuple(cache(3).unbind(0))}, "KBNHC")  # the tuple stands for K
    assert k_and_v.member_axes == "BNHC" and len(k_and_v.members) == 2


def test_a_member_s_repr_leaves_out_what_torch_reports_of_its_storage():
    member = CacheSet({"l": cache()}, "KBNHC").members[0]
    text = repr(member)
    assert "address=" in text and "data_ptr=" not in text and "storage_bytes=" not in text
    assert "storage=" not in text  # a storage's repr lists its every byte: gigabytes for a cache


def test_describes_answers_true_or_false():
    a, b = cache(), cache(2)
    cache_set = CacheSet({"a": a, "b": (b,)}, "KBNHC")
    assert cache_set.describes({"a": a, "b": (b,)}) is True
    assert cache_set.describes({"a": a}) is False  # a layer fewer
    assert cache_set.describes([a, b]) is False  # type: ignore[arg-type]  # not a mapping
    assert cache_set.describes({"a": a, "b": (b, b)}) is False  # a tensor more
    assert cache_set.describes({"a": a, "b": (cache(2),)}) is False  # another tensor


def test_a_layer_with_more_source_than_destination_tensors_is_refused():
    # Four members a side, so no split by K: layer a has three tensors in src, two in dst.
    k = make_cache("BNHC", "BNHC", SIZES)
    src = {"a": (k, k.clone(), k.clone()), "b": (k.clone(),)}
    dst = {"a": tuple(empty().unbind(0)), "b": tuple(empty().unbind(0))}
    with pytest.raises(kvhost.LayoutError, match="layer 'a': 3 source tensors but 2 destination tensors"):
        kvhost.copy_blocks(src, dst, [1], [1], axes="KBNHC")


def test_of_two_destinations_a_source_meets_the_first_named_is_reported():
    # Source layer a spans buffer blocks 4..12; destination a (blocks 8..16) and b
    # (blocks 0..8) both meet it, b at lower addresses. The copy reads a's block 0
    # (buffer 4) and 5 (buffer 9) and writes blocks 1 and 4: buffer 9 and 12 of dst a,
    # buffer 1 and 4 of dst b. Both are refused; dst a is checked first, as named.
    buffer = fill_random(torch.zeros(16, 8, 2, 4, dtype=torch.bfloat16), 7)
    src = {"a": buffer[4:12], "b": fill_random(torch.zeros(8, 8, 2, 4, dtype=torch.bfloat16), 8)}
    dst = {"a": buffer[8:16], "b": buffer[0:8]}
    before = raw(buffer).clone()
    with pytest.raises(kvhost.RequestError) as raised:
        kvhost.copy_blocks(src, dst, [0, 5], [4, 1], axes="BNHC")
    assert "source layer 'a'[0] block 5 is destination layer 'a'[0] block 1" in str(raised.value)
    assert torch.equal(raw(buffer), before)


def test_a_copy_result_s_job_is_the_batch_s_first():
    # Layers of two layouts make two jobs; the result keeps the first (layer a's).
    src = {"a": cache(), "b": make_cache("KBNHC", "KBHNC", SIZES)}
    dst = {"a": empty(), "b": empty()}
    result = kvhost.copy_blocks(src, dst, [1, 2, 5], [3, 4, 6], axes="KBNHC")
    assert result.job is not None and [s.layer for s, _ in result.job.pairs] == ["a"]
    assert result.runs == 2


def test_a_peer_in_any_mapping_is_read_once_while_it_holds_the_same_tensors(monkeypatch):
    # Not only dicts: a read-only view of an engine's dict is a mapping too, and choosing the
    # backend must not read the whole set to find the first tensor's device.
    import types

    import kvhost.api

    host = kvhost.KVHost({"a": cache(), "b": cache(2)}, axes="KBNHC")
    reads: list[object] = []
    real = kvhost.api.CacheSet

    def counted(caches, *args, **kwargs):  # type: ignore[no-untyped-def]
        reads.append(caches)
        return real(caches, *args, **kwargs)

    monkeypatch.setattr(kvhost.api, "CacheSet", counted)
    peer = types.MappingProxyType({"a": empty(), "b": empty()})
    host.copy_to(peer, [1], [1])
    host.copy_to(peer, [2], [2])
    assert reads == [peer]
    assert torch.equal(raw(peer["b"][:, 2]), raw(host.caches.layers["b"][0].tensor[:, 2]))


def test_a_group_s_repr_leaves_out_what_a_backend_derived_from_it():
    # A backend keeps arrays and views in ``derived``; a group printed while debugging stays short.
    src, dst = CacheSet({"a": cache()}, "KBNHC"), CacheSet({"a": cache(2)}, "KBNHC")
    (copy_group,) = src.copy_groups(dst).groups
    (receive_group,) = src.receive_groups("HNC", 4)
    for group in (copy_group, receive_group):
        group.derived["cpu"] = "what-a-backend-derived"
        text = repr(group)
        assert "what-a-backend-derived" not in text and "derived" not in text
        assert text.startswith(type(group).__name__ + "(")


def test_layers_given_as_lists_are_the_tensors_registered_even_when_the_list_changes():
    # A K/V list is the engine's object: what it holds later is not what was registered.
    k, v = cache(1).unbind(0)
    expected = (k.clone(), v.clone())
    kvhost.receive({"a": expected}, {"r": [1]}, axes="KBNHC", remote_order="HNC", remote_block_size=4)
    given = [k, v]
    host = kvhost.KVHost({"a": given}, axes="KBNHC")
    stranger = torch.zeros_like(k)
    given[0] = stranger
    host.receive({"r": [1]}, remote_order="HNC", remote_block_size=4, layers=["a"])
    assert torch.equal(raw(k), raw(expected[0])) and torch.equal(raw(v), raw(expected[1]))
    assert not raw(stranger).any(), "a tensor put in the list after registering was written"


def test_copies_with_a_peer_on_the_registered_device_or_the_host_run_on_the_registered_backend():
    # A backend instance given to KVHost serves its device's copies whatever the registry
    # would pick: with a host peer, and with a peer on the same device.
    from kvhost.backend import Backend, Completion

    class Recording(Backend):
        name = "recording"
        device_types = ("meta",)

        def __init__(self) -> None:
            self.copies: list[tuple[str, str]] = []

        def receive(self, job):  # type: ignore[no-untyped-def]
            raise AssertionError("no receive here")

        def copy(self, job):  # type: ignore[no-untyped-def]
            self.copies.append((job.src_device.type, job.dst_device.type))
            return Completion()

    recording = Recording()
    host = kvhost.KVHost({"a": cache(device="meta")}, axes="KBNHC", backend=recording)
    host.copy_from({"a": empty()}, [1], [2]).wait()  # a host buffer
    host.copy_to({"a": cache(device="meta")}, [2], [3]).wait()  # another tensor on the device
    assert recording.copies == [("cpu", "meta"), ("meta", "meta")]
