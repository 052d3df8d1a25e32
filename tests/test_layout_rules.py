"""The layout rules and the overlap arithmetic, case by case, at their edges.

Each test pins one rule of docs/design.md ("Words", "Memory safety") where the
conformance suite never goes: layouts it never builds (channels outside the block region,
two axes on one stride, size-1 axes with odd strides, one block), storages one byte
short, lanes whose blocks overlap themselves, and the point where interleaved lanes are
too many to list. Found by mutation testing (ci/mutation.py): each test here fails on a
change to kvhost/layout.py or kvhost/memory.py that the rest of the suite let pass.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvhost
from kvhost import memory
from kvhost.layout import Layout, contiguous_strides
from kvhost.memory import MAX_LISTED_BLOCKS, Lane, byte_extent, find_overlap, first_shared
from kvhost.testing import ReceiveCase, make_cache


def layout_error(tensor: torch.Tensor, axes: str) -> str:
    with pytest.raises(kvhost.LayoutError) as raised:
        Layout.of(tensor, axes)
    return str(raised.value)


# --- what a layout is made of -------------------------------------------------------------


def test_only_tensors_of_1_2_4_or_8_byte_items_have_layouts():
    assert Layout.of(torch.zeros(4, 8, 2, dtype=torch.float64), "BNC").itemsize == 8
    assert Layout.of(torch.zeros(4, 8, 2, dtype=torch.int8), "BNC").itemsize == 1
    assert "item size 16 of torch.complex128" in layout_error(torch.zeros(4, 8, 2, dtype=torch.complex128), "BNC")
    assert "expected a torch.Tensor, got ndarray" in layout_error(np.zeros((4, 8, 2)), "BNC")  # type: ignore[arg-type]


def test_a_letter_a_layout_lacks_has_size_1():
    layout = Layout.of(torch.zeros(4, 8, 2), "BNC")
    assert [layout.size(a) for a in "BNCLKH"] == [4, 8, 2, 1, 1, 1]


def test_known_returns_only_layouts_already_validated():
    tensor = torch.zeros(3, 5, 7)  # a shape no other test uses
    assert Layout.known(tensor, "BNC") is None
    layout = Layout.of(tensor, "BNC")
    assert Layout.known(torch.zeros(3, 5, 7), "BNC") is layout
    assert Layout.known(tensor, "NBC") is None  # another naming of the dims is another layout


def test_contiguous_strides_are_torch_s_row_major_strides():
    for shape in [(2, 3, 4), (2, 1, 3), (1, 1, 5), (2, 0, 3), (7,), ()]:
        assert contiguous_strides(shape) == torch.empty(shape).stride(), shape


def test_extent_is_the_span_from_first_to_last_element():
    dense = torch.zeros(2, 4, 8, 3, dtype=torch.bfloat16)
    assert Layout.of(dense, "KBNC").extent_bytes == dense.numel() * 2 == byte_extent(dense)
    every_other_block = torch.zeros(2, 8, 8, 3, dtype=torch.bfloat16)[:, ::2]
    expected = ((2 - 1) * 8 * 24 + (4 - 1) * 2 * 24 + 7 * 3 + 2 + 1) * 2
    assert Layout.of(every_other_block, "KBNC").extent_bytes == expected == byte_extent(every_other_block)
    assert byte_extent(torch.zeros(0, 3)) == 0
    assert byte_extent(torch.zeros(3, 0)) == 0  # (3 - 1) * 1 + (0 - 1) * 1 would say 2 items
    assert byte_extent(torch.zeros(2, 0, 5)) == 0
    assert byte_extent(torch.zeros(1, dtype=torch.float64)) == 8  # one element is not empty


# --- layouts refused, each for its own reason ----------------------------------------------


def test_channels_outside_the_block_region_are_refused():
    t = make_cache("KBNHC", "CKBNH", dict(K=2, B=4, N=8, H=2, C=4))
    assert "channels (C) must lie inside the block region" in layout_error(t, "KBNHC")


def test_two_axes_on_one_stride_are_refused():
    t = torch.zeros(5 * 64).as_strided((4, 8, 2, 4), (64, 8, 8, 1))  # N and H both step 8
    assert "axes N and H share stride 8: memory overlaps" in layout_error(t, "BNHC")


def test_too_few_dims_for_the_axes_are_named_with_the_shape():
    message = layout_error(torch.zeros(4, 8, 2), "BNHC")
    assert "axes 'BNHC' name 4 dims but the tensor has 3 (shape (4, 8, 2))" in message


def test_a_broadcast_k_is_named_as_such():
    t = torch.zeros(1, 4, 8, 2, 4).expand(2, 4, 8, 2, 4)
    assert "axis K has stride 0 (a broadcast view)" in layout_error(t, "KBNHC")


def test_blocks_closer_than_their_region_are_refused():
    for blocks in (2, 4):
        t = torch.zeros(200).as_strided((blocks, 8, 4), (16, 4, 1))  # a region is 32 items, blocks step 16
        assert "block stride 16 is smaller than the region (32 elements): blocks would overlap" in layout_error(
            t, "BNC"
        )


def test_one_block_may_have_any_block_stride():
    t = torch.zeros(64).as_strided((1, 8, 4), (9, 4, 1))  # no second block to overlap
    layout = Layout.of(t, "BNC")
    assert layout.region == "NC" and layout.num_blocks == 1


def test_size_1_axes_in_the_region_may_have_any_stride():
    # One head with stride 3 inside a dense N C region: a size-1 axis steps nowhere.
    t = torch.zeros(4 * 64).as_strided((4, 8, 1, 8), (64, 8, 3, 1))
    layout = Layout.of(t, "BNHC")
    assert layout.region == "NHC" and layout.region_bytes == 64 * 4
    case = ReceiveCase({"l": t}, "BNHC", seed=2)
    case.send("r", [1, 2], "CNH", 4)
    kvhost.receive({"l": t}, {"r": [1, 2]}, axes="BNHC", remote_order="CNH", remote_block_size=4)
    case.check()


def test_a_size_1_letter_on_the_stride_of_its_neighbour_goes_inside_it():
    """One head, stored inside B but named before it: B and H share a stride, and H, which
    steps nowhere, is taken as inside B (no outer letter, one region per block)."""
    t = torch.zeros(4, 1, 8, 2).permute(1, 0, 2, 3)  # shape order H B N C, H's stride equal to B's
    assert t.stride(0) == t.stride(1)
    layout = Layout.of(t, "HBNC")
    assert (layout.physical, layout.outer, layout.region) == ("BHNC", "", "HNC")


@pytest.mark.parametrize(("letter", "sizes"), [("N", dict(N=1, H=2, C=4)), ("C", dict(N=4, H=2, C=1))])
def test_tokens_or_channels_of_size_1_stored_before_b_lie_just_inside_it(letter, sizes):
    """A size-1 letter steps nowhere: a permuted view may give it a stride larger than B's,
    and a letter that must lie in the block region is taken as lying just inside B."""
    stored = torch.zeros(1, 6, *(sizes[a] for a in "NHC" if a != letter))  # the size-1 letter first
    t = stored.movedim(0, 1 + "NHC".index(letter))  # shape order B N H C, the letter's stride largest
    assert t.stride(1 + "NHC".index(letter)) > t.stride(0)
    layout = Layout.of(t, "BNHC")
    assert layout.physical == "B" + letter + "NHC".replace(letter, "") and layout.outer == ""
    assert layout.region_bytes == 8 * 4 and layout.block_stride_bytes == 8 * 4
    case = ReceiveCase({"l": t}, "BNHC", seed=3)
    case.send("r", [1, 4], "CHN", 1 if letter == "N" else 4)
    kvhost.receive(
        {"l": t}, {"r": [1, 4]}, axes="BNHC", remote_order="CHN", remote_block_size=1 if letter == "N" else 4
    )
    case.check()


def test_blocks_of_one_token_need_the_senders_order_named_when_its_blocks_are_larger():
    """Where N of size 1 sits in a region is its stride's accident: two contiguous tensors of
    one shape read NHC and HNC. With the sender's order left to default, the same landed
    bytes would be rearranged two ways; it must be named, and then both agree with the wire."""
    dense = torch.zeros(4, 1, 2, 2)  # B N H C: N shares B's stride
    transposed = torch.zeros(4, 2, 1, 2).transpose(1, 2)  # the same shape and bytes: N shares H's
    assert dense.is_contiguous() and transposed.is_contiguous()
    assert (Layout.of(dense, "BNHC").region, Layout.of(transposed, "BNHC").region) == ("NHC", "HNC")
    caches = {"dense": dense, "transposed": transposed}
    with pytest.raises(kvhost.KVHostError, match=r"blocks of one token here \('NHC' by their strides\) do not say"):
        kvhost.receive(caches, {"r": [0, 1, 2, 3]}, axes="BNHC", remote_block_size=4)
    with pytest.raises(kvhost.KVHostError, match=r"request 'r': .*'HNC' by their strides\) do not say where"):
        kvhost.receive({"t": transposed}, {"r": kvhost.Incoming([0, 1, 2, 3], remote_block_size=4)}, axes="BNHC")
    assert not dense.any() and not transposed.any()
    for order in ("NHC", "HNC"):
        case = ReceiveCase(caches, "BNHC", seed=5)
        case.send("r", [0, 1, 2, 3], order, 4)
        kvhost.receive(caches, {"r": [0, 1, 2, 3]}, axes="BNHC", remote_order=order, remote_block_size=4)
        case.check()
    kvhost.receive(caches, {"r": [2]}, axes="BNHC")  # blocks of one token on both sides: nothing to name
    lone = torch.arange(4.0).reshape(4, 1, 1, 1)  # a block holds one value: every order is its bytes
    kvhost.receive({"t": lone}, {"r": [0, 1, 2, 3]}, axes="BNHC", remote_block_size=4)
    assert lone.flatten().tolist() == [0.0, 1.0, 2.0, 3.0]


# --- lanes and overlaps --------------------------------------------------------------------


def test_a_lane_ends_where_its_last_block_ends():
    assert Lane(100, 64, 5, 48, "x").end == 100 + 4 * 64 + 48
    assert Lane(100, 64, 1, 48, "x").end == 148


def test_a_lane_whose_own_blocks_overlap_is_found():
    lane = Lane(0, 16, 4, 32, "x")  # block 0 is bytes 0..32, block 1 starts at 16
    found = find_overlap([lane])
    assert found is not None
    assert (found.first, found.first_block, found.second, found.second_block) == (lane, 0, lane, 1)
    pair = Lane(0, 16, 2, 32, "two")  # two blocks are enough to overlap
    found = find_overlap([pair])
    assert found is not None and (found.first, found.first_block, found.second_block) == (pair, 0, 1)
    assert find_overlap([Lane(0, 16, 1, 32, "x")]) is None  # one block overlaps nothing


def test_the_pair_named_is_a_real_pair_of_blocks():
    # A one-block lane over the first five blocks of a dense lane: the pair named is
    # the dense lane's last block that meets it (block 4, not 5 or 6, which do not exist).
    one = Lane(0, 100, 1, 80, "one")
    dense = Lane(10, 10, 5, 10, "dense")  # blocks at 10, 20, 30, 40, 50
    found = find_overlap([one, dense])
    assert found is not None
    assert (found.first.owner, found.first_block, found.second.owner, found.second_block) == ("one", 0, "dense", 4)
    found = find_overlap([Lane(0, 10, 10, 10, "wide"), Lane(35, 10, 1, 10, "late")])
    assert found is not None and (found.first_block, found.second_block) == (3, 0)
    found = find_overlap([Lane(0, 1, 4, 1, "bytes"), Lane(2, 1, 1, 1, "byte")])  # one-byte blocks
    assert found is not None and (found.first_block, found.second_block) == (2, 0)
    # Of several overlapping pairs, the first in address order is named.
    x, y, z = Lane(0, 10, 1, 10, "x"), Lane(5, 10, 1, 10, "y"), Lane(12, 10, 1, 10, "z")
    found = find_overlap([z, y, x])
    assert found is not None and (found.first.owner, found.second.owner) == ("x", "y")


def test_an_earlier_cluster_is_settled_before_a_later_one():
    # a and b overlap (listed: their strides differ); c and d, which start where b ends,
    # overlap too (by arithmetic). Lanes that only touch are separate clusters, so the
    # first overlap in address order is the one named.
    a = Lane(0, 100, 2, 10, "a")  # 0..10, 100..110
    b = Lane(45, 30, 3, 10, "b")  # 45..55, 75..85, 105..115
    c, d = Lane(115, 0, 1, 10, "c"), Lane(120, 0, 1, 10, "d")
    found = find_overlap([d, c, b, a])
    assert found is not None
    assert (found.first.owner, found.first_block, found.second.owner, found.second_block) == ("a", 1, "b", 2)


def test_lanes_that_only_touch_are_compared_with_nothing(monkeypatch):
    """Lanes laid end to end (each layer's K, then each layer's V, of one buffer: the
    layers' spans all meet) are clusters of one: nothing to compare, so none is compared
    (each comparison was some 90 us: a copy into 96 layer views of one buffer took 9.3 ms
    against 2.9 ms once they were not)."""
    compared: list[int] = []
    real = memory._overlap_in_cluster
    monkeypatch.setattr(memory, "_overlap_in_cluster", lambda cluster: compared.append(len(cluster)) or real(cluster))
    touching = [Lane(i * 160, 10, 16, 10, f"l{i}") for i in range(64)]
    assert find_overlap(touching[::-1]) is None and compared == []
    found = find_overlap([*touching, Lane(5 * 160 + 150, 10, 2, 10, "across")])  # l5's last block and l6's first
    assert found is not None and compared == [3]  # l5, across and l6: one cluster
    assert (found.first.owner, found.first_block, found.second.owner, found.second_block) == ("l5", 15, "across", 0)


def test_within_a_cluster_pairs_with_one_stride_are_settled_before_any_is_listed():
    # a and b interleave with different strides (a's block 1 meets b's block 0): such a
    # pair is listed block by block, which costs; c, one block over b's block 1, is settled
    # by arithmetic first, and that overlap is the one named.
    a = Lane(0, 10, 3, 4, "a")  # 0..4, 10..14, 20..24
    b = Lane(12, 20, 2, 4, "b")  # 12..16, 32..36
    c = Lane(33, 0, 1, 4, "c")  # 33..37
    found = find_overlap([a, b, c])
    assert found is not None
    assert (found.first.owner, found.first_block, found.second.owner, found.second_block) == ("b", 1, "c", 0)
    found = find_overlap([a, b])
    assert found is not None
    assert (found.first.owner, found.first_block, found.second.owner, found.second_block) == ("a", 1, "b", 0)


def test_one_block_lanes_meet_by_their_bytes_whatever_their_stride():
    found = find_overlap([Lane(0, 0, 1, 8, "a"), Lane(4, 0, 1, 8, "b")])
    assert found is not None and (found.first_block, found.second_block) == (0, 0)
    assert find_overlap([Lane(0, 0, 1, 8, "a"), Lane(8, 0, 1, 8, "b")]) is None


def test_a_block_past_the_end_of_a_lane_is_no_block():
    assert find_overlap([Lane(0, 10, 2, 10, "a"), Lane(25, 10, 1, 10, "b")]) is None  # a's block 2 would meet b


def test_lanes_with_different_strides_are_compared_block_by_block():
    # Two blocks each way; the strides differ, so no stride-based arithmetic applies.
    a = Lane(0, 100, 2, 10, "a")  # 0..10, 100..110
    b = Lane(45, 30, 3, 10, "b")  # 45..55, 75..85, 105..115
    found = find_overlap([a, b])
    assert found is not None and (found.first_block, found.second_block) == (1, 2)
    assert find_overlap([a, Lane(50, 30, 2, 10, "c")]) is None  # 50..60, 80..90: between a's blocks


def test_interleaved_lanes_are_listed_up_to_a_bound():
    half = MAX_LISTED_BLOCKS // 2
    # Two lanes whose blocks interleave without meeting, with different strides.
    a = Lane(0, 64, half, 16, "a")  # bytes 0..16 of every 64
    b = Lane(32, 128, half, 16, "b")  # bytes 32..48 of every other 64
    assert find_overlap([a, b]) is None  # exactly the bound: listed
    c = Lane(32, 128, half + 1, 16, "c")
    with pytest.raises(kvhost.LayoutError, match=f"over {2 * half + 1} blocks: too irregular"):
        find_overlap([a, c])


def test_the_listing_bound_is_4_mi_blocks():
    # The bound itself (MAX_LISTED_BLOCKS, 2**22): interleaved lanes of 2**21 blocks each
    # are listed and accepted; one block more is refused.
    a = Lane(0, 64, 1 << 21, 16, "a")
    assert find_overlap([a, Lane(32, 128, 1 << 21, 16, "b")]) is None
    with pytest.raises(kvhost.LayoutError, match="over 4194305 blocks: too irregular"):
        find_overlap([a, Lane(32, 128, (1 << 21) + 1, 16, "c")])


def test_lanes_that_do_not_meet_are_never_listed():
    # a and b are adjacent, too big to list beside each other, with different strides;
    # c reaches over both (one cluster) with a block before a and one after b.
    half = MAX_LISTED_BLOCKS // 2 + 1
    a = Lane(1000, 64, half, 16, "a")
    b = Lane(a.end, 96, half, 16, "b")
    c = Lane(0, b.end + 10, 2, 16, "c")
    assert find_overlap([c, a, b]) is None


def test_a_one_block_lane_beside_millions_of_blocks_is_compared_without_listing():
    many = Lane(16, 64, MAX_LISTED_BLOCKS, 16, "many")
    found = find_overlap([Lane(16, 7, 1, 8, "head"), many])  # over many's block 0
    assert found is not None and (found.first.owner, found.second.owner, found.second_block) == ("head", "many", 0)
    assert find_overlap([many, Lane(40, 7, 1, 8, "inside")]) is None  # between many's blocks 0 and 1


def test_first_shared_names_a_block_both_read_and_written():
    # Within one lane, the smallest such block id; across lanes, the first block read.
    lane = Lane(0, 64, 16, 64, "x")
    reads = np.array([9, 3, 5, 7])
    writes = np.array([5, 9, 11])
    found = first_shared(lane, reads, lane, writes)
    assert found is not None and (found.first_block, found.second_block) == (5, 5)  # the smallest shared id
    other = Lane(32, 64, 16, 64, "y")  # half a block on: x block i meets y blocks i - 1 and i
    found = first_shared(lane, reads, other, np.array([2, 8]))
    assert found is not None and (found.first_block, found.second_block) == (9, 8)
    assert first_shared(lane, reads, Lane(lane.end, 64, 4, 64, "z"), np.array([0, 1])) is None


def test_a_batched_tensor_under_vmap_is_refused_as_having_no_memory_of_its_own():
    """functorch's batched tensor: strided, on the CPU, with neither a data pointer nor a
    storage to ask (both raise); the kernels would have been given address 0."""
    refused: list[str] = []

    def call(cache: torch.Tensor) -> torch.Tensor:
        with pytest.raises(kvhost.LayoutError, match="a Tensor with no memory of its own has no address") as err:
            kvhost.receive({"l": cache}, {"a": [0]}, axes="BNHC", remote_order="HNC", remote_block_size=4)
        refused.append(str(err.value))
        return cache

    torch.func.vmap(call)(torch.zeros(2, 8, 8, 2, 4))
    assert refused == ["caches layer 'l'[0]: a Tensor with no memory of its own has no address to move its blocks at"]


# --- a layout made by hand -----------------------------------------------------------------


def test_a_layout_made_by_hand_is_the_one_of_reads_from_a_tensor():
    t = torch.zeros(4, 16, 2, 8, dtype=torch.float16)
    made = Layout("BNHC", t.shape, t.stride(), 2)  # a torch.Size is a tuple
    assert made == Layout.of(t, "BNHC")
    assert type(made.shape) is tuple and hash(made) == hash(Layout.of(t, "BNHC"))


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        (("BNHC", (4, 8, 2, 4), (64, 8, 8, 1), 4), "axes N and H share stride 8: memory overlaps"),
        (("BNHC", (4, 8, 2, 4), (64, 8, 4, 1), 3), "item size 3 is not 1, 2, 4 or 8 bytes"),
        (("BNHC", (4, 8, 2, 4), (64, 8, 4, 1), True), "item size True is not"),
        (("BNHC", [4, 8, 2, 4], (64, 8, 4, 1), 4), "shape must be a tuple of ints, got [4, 8, 2, 4]"),
        (("BNHC", (4, 8, True, 4), (64, 8, 4, 1), 4), "shape must be a tuple of ints"),
        (("BNHC", (4, 8, 2, 4), (64, 8, 4.0, 1), 4), "strides must be a tuple of ints"),
        (("BNHC", (4, 8, 2, 4), (64, 8, 4), 4), "shape (4, 8, 2, 4) has 4 dims but strides (64, 8, 4)"),
        (("BNHC", (4, 8, 2), (16, 2, 1), 4), "axes 'BNHC' name 4 dims but the tensor has 3"),
        (("BHC", (4, 2, 4), (8, 4, 1), 4), "lack required letter(s) 'N'"),
        (("BNHX", (4, 8, 2, 4), (64, 8, 4, 1), 4), "unknown letter(s) 'X'"),
        ((None, (4,), (1,), 4), "axes"),
    ],
)
def test_a_layout_made_by_hand_is_checked_as_of_checks_a_tensor(fields, words):
    with pytest.raises(kvhost.LayoutError) as raised:
        Layout(*fields, name="hand-made")
    assert str(raised.value).startswith("hand-made: ") and words in str(raised.value)


def test_a_senders_view_may_be_read_without_its_regions_checked_but_not_its_kinds():
    """kvhost.testing's connectors read a sender's share of heads (regions with other heads
    between) as it is: ``regions_checked=False`` skips the contiguity rule, nothing else."""
    shape, strides = (6, 2, 2, 4), (48, 24, 4, 1)  # H every 24 elements: N, C fill 8 of them
    with pytest.raises(kvhost.LayoutError, match="is not contiguous"):
        Layout("BHNC", shape, strides, 2)
    read = Layout("BHNC", shape, strides, 2, regions_checked=False)
    assert read.region == "HNC" and read == Layout("BHNC", shape, strides, 2, name="other", regions_checked=False)
    with pytest.raises(kvhost.LayoutError, match="item size 3"):
        Layout("BHNC", shape, strides, 3, regions_checked=False)
    with pytest.raises(kvhost.LayoutError, match="shape must be a tuple of ints"):
        Layout("BHNC", [6, 2, 2, 4], strides, 2, regions_checked=False)
