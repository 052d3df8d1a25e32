"""Layouts read from strides, regions, and plans derived from letters alone."""

from __future__ import annotations

import pytest
import torch

from kvhost.layout import Layout
from kvhost.testing import fill_random, make_cache
from kvhost.transform import plan_copy, plan_receive

SIZES = dict(L=3, K=2, B=10, N=16, H=4, C=8)


@pytest.mark.parametrize(
    ("axes", "physical", "outer", "region"),
    [
        ("KBNHC", "KBNHC", "K", "NHC"),  # FlashAttention NHD
        ("KBNHC", "KBHNC", "K", "HNC"),  # logical NHD over HND memory
        ("BKNHC", "BKNHC", "", "KNHC"),  # FlashInfer
        ("BHNC", "HBNC", "H", "NC"),  # per-head regions
        ("BNC", "BNC", "", "NC"),  # MLA
        ("LBHNC", "BLHNC", "", "LHNC"),  # cross-layer blocks
        ("LBHNC", "LBNHC", "L", "NHC"),
        ("BNHKC", "BNHKC", "", "NHKC"),  # K/V interleaved per head
    ],
)
def test_physical_order_outer_and_region(axes, physical, outer, region):
    layout = Layout.of(make_cache(axes, physical, SIZES, device="meta"), axes)
    assert layout.physical == physical
    assert layout.outer == outer
    assert layout.region == region
    sizes = {a: SIZES[a] for a in axes}
    assert layout.region_bytes == 2 * torch.tensor([sizes[a] for a in region]).prod().item()


def test_size_one_axes_fall_inside_their_partner():
    # One KV head in HND memory: H ties with B in stride and must land in the region.
    tensor = torch.empty(10, 1, 16, 8).permute(0, 2, 1, 3)  # shape B N H C over B H N C memory
    layout = Layout.of(tensor, "BNHC")
    assert layout.region in ("HNC", "NHC")
    assert layout.outer == ""


def test_outer_offsets_for_every_outer_index():
    tensor = make_cache("LBHNC", "LKBNHC".replace("K", ""), SIZES, device="meta")
    layout = Layout.of(tensor, "LBHNC")
    per_layer = 10 * 16 * 4 * 8 * 2  # bytes of one layer's blocks
    assert layout.outer == "L"
    assert layout.outer_offsets_bytes.tolist() == [0, per_layer, 2 * per_layer]


def test_layouts_are_interned_and_planning_never_reads_data():
    # "meta" tensors have shape and strides but no data: planning works on them alone.
    a = Layout.of(make_cache("KBNHC", "KBHNC", SIZES, device="meta"), "KBNHC")
    b = Layout.of(make_cache("KBNHC", "KBHNC", SIZES, device="meta"), "KBNHC")
    assert a is b
    assert plan_receive(a, "HNC", 4) is plan_receive(b, "HNC", 4)  # cached
    assert plan_copy(a, b) is plan_copy(a, b)


@pytest.mark.parametrize(
    ("physical", "order", "remote", "identity"),
    [
        ("KBNHC", "NHC", 16, True),
        ("KBNHC", "NHC", 4, True),  # token-major both sides, any r
        ("KBNHC", "NHC", 64, True),  # and any g
        ("KBNHC", "HNC", 16, False),
        ("KBHNC", "HNC", 16, True),
        ("KBHNC", "HNC", 4, False),  # head-major both sides but sizes differ: heads interleave
        ("KBHNC", "NHC", 16, False),
    ],
)
def test_identity_detection(physical, order, remote, identity):
    layout = Layout.of(make_cache("KBNHC", physical, SIZES, device="meta"), "KBNHC")
    assert (plan_receive(layout, order, remote) is None) == identity


def test_hnd16_to_nhd64_plan_is_a_transpose_per_sub_block():
    sizes = dict(K=2, B=4, N=64, H=8, C=128)
    layout = Layout.of(make_cache("KBNHC", "KBNHC", sizes, device="meta"), "KBNHC")
    plan = plan_receive(layout, "HNC", 16)
    assert plan is not None
    assert plan.parts == 1
    assert plan.src_shape == (4, 8, 16, 128)  # sub-block, head, token, channel
    assert plan.perm == (0, 2, 1, 3)  # sub-block, token, head, channel
    write_back = plan.write_back
    assert write_back.pieces == 4 and write_back.piece_bytes == 16 * 8 * 128 * 2
    assert write_back.loops.run_bytes == 256
    assert write_back.loops.shape == (16, 8)


def test_remote_larger_plan_spans_a_group_of_regions():
    sizes = dict(K=2, B=8, N=16, H=8, C=128)
    layout = Layout.of(make_cache("KBNHC", "KBNHC", sizes, device="meta"), "KBNHC")
    plan = plan_receive(layout, "HNC", 64)
    assert plan is not None and plan.parts == 4
    assert plan.unit_bytes == 4 * layout.region_bytes
    assert plan.write_back.pieces == 1 and plan.write_back.part_stride == 16 * 128 * 2


def test_copy_plan_merges_whole_blocks_when_layouts_agree():
    layout = Layout.of(make_cache("KBNHC", "KBNHC", SIZES, device="meta"), "KBNHC")
    plan = plan_copy(layout, layout)
    assert plan.merge_blocks
    assert plan.loops.shape == (2,) and plan.loops.run_bytes == layout.region_bytes
    other = Layout.of(make_cache("KBNHC", "KBHNC", SIZES, device="meta"), "KBNHC")
    assert not plan_copy(layout, other).merge_blocks


def test_checked_letter_strings_are_read_by_their_own_characters_and_remembered_as_plain_strings():
    # A string that passed is remembered so the next call is a set lookup. A str subclass
    # may lie about its letters, its hash and ==: it is read by its own characters
    # (str.__str__), refused as what it spells, and what passes is a plain string.
    from kvhost.errors import LayoutError
    from kvhost.layout import _good_letters, checked_letters

    class Lying(str):
        def __iter__(self):  # type: ignore[no-untyped-def]
            return iter("HNC")

        def count(self, *args):  # type: ignore[no-untyped-def]
            return 1

        def __len__(self):  # type: ignore[no-untyped-def]
            return 0

    with pytest.raises(LayoutError, match="order 'HXQ' has unknown letter"):
        checked_letters(Lying("HXQ"), what="order")
    with pytest.raises(LayoutError, match="order 'HXQ' has unknown letter"):
        checked_letters("HXQ", what="order")
    letters = checked_letters(Lying("CHN"), what="order")
    assert type(letters) is str and letters == "CHN" and "CHN" in _good_letters and "HXQ" not in _good_letters
    refusal = r"must be a non-empty string of axis letters from 'LKBNHC', got \['ab', .*\.\.\.$"
    with pytest.raises(LayoutError, match=refusal):
        checked_letters(["ab"] * 100, what="order")
    with pytest.raises(LayoutError, match=r"order 'XXXX.*\.\.\. has unknown letter\(s\) 'X'; known") as refused:
        checked_letters("X" * 10**6, what="order")
    assert len(str(refused.value)) < 200


def test_a_str_subclass_that_hashes_as_another_order_is_received_as_what_it_spells():
    """Plans are cached by order: a subclass hashing and comparing equal to a cached order
    (the identity, here) was handed that order's plan, and its blocks were left unrearranged."""
    import kvhost
    from kvhost.testing import ReceiveCase

    class Posing(str):
        def __hash__(self):  # type: ignore[no-untyped-def]
            return hash("NHC")

        def __eq__(self, other):  # type: ignore[no-untyped-def]
            return True

    case = ReceiveCase({"l": make_cache("KBNHC", "KBNHC", dict(SIZES, B=8, N=8))}, "KBNHC")
    case.send("a", [1, 2], "HNC", 8)
    host = kvhost.KVHost(case.caches, axes="KBNHC")
    host.receive({}, remote_order="NHC", remote_block_size=8)  # the identity's plan, cached
    stats = host.receive({"a": kvhost.Incoming([1, 2], Posing("HNC"), 8)})
    assert stats.bytes_moved > 0 and stats.skipped_blocks == 0
    case.check()


@pytest.mark.parametrize("sizes", [(2, 4, 2, 8), (1, 4, 2, 8), (2, 1, 2, 8), (2, 4, 1, 8), (1, 1, 1, 8), (2, 4, 2, 1)])
def test_a_one_block_cache_reads_as_its_many_block_twin_in_every_allocation_order(sizes):
    """A size-1 ``B`` has a stride that ties with a neighbour's: in whatever order the cache
    was allocated (then viewed as ``KBNHC``), one block reads as the same physical order
    of its sized axes and the same region as two blocks do, and is refused only where two
    blocks are."""
    import itertools

    from kvhost.errors import LayoutError

    k, n, h, c = sizes
    for allocated in map("".join, itertools.permutations("KBNHC")):
        read = {}
        for blocks in (1, 2):
            size = dict(K=k, B=blocks, N=n, H=h, C=c)
            tensor = torch.zeros([size[a] for a in allocated]).permute([allocated.index(a) for a in "KBNHC"])
            try:
                layout = Layout.of(tensor, "KBNHC")
                sized = "".join(a for a in layout.physical if a == "B" or layout.size(a) > 1)
                read[blocks] = (sized, layout.region_bytes)  # where a size-1 axis sits is no fact
            except LayoutError:
                read[blocks] = None
        assert read[1] == read[2] or (read[2] is None and read[1] is not None), (allocated, read)


@pytest.mark.parametrize("place", range(5))
@pytest.mark.parametrize("sizes", [(2, 4, 2, 8), (2, 2, 2, 1), (1, 1, 2, 2)])
def test_a_single_block_reads_as_unsqueeze_at_its_place_in_the_shape_would_make_it(sizes, place):
    """Wherever ``B`` sits in the shape (first, between, last), a stride of 0 or 1 that puts
    it inside the tokens and channels reads as ``unsqueeze(place)`` makes it: the same
    physical order, region and refusal."""
    import itertools

    import kvhost

    k, n, h, c = sizes
    axes = "KNHC"[:place] + "B" + "KNHC"[place:]
    for allocated in map("".join, itertools.permutations("KNHC")):
        size = dict(K=k, N=n, H=h, C=c)
        base = torch.zeros([size[a] for a in allocated]).permute([allocated.index(a) for a in "KNHC"])
        unsqueezed = base.unsqueeze(place)

        def read(tensor: torch.Tensor) -> tuple[str, str] | None:
            try:
                layout = Layout.of(tensor, axes)
            except kvhost.LayoutError:
                return None
            return layout.physical, layout.region

        for stride in (0, 1):
            strides = list(unsqueezed.stride())
            strides[place] = stride
            given = unsqueezed.as_strided(unsqueezed.shape, strides)
            if read(unsqueezed) is not None or stride == 0:
                assert read(given) == read(unsqueezed), (allocated, axes, stride)
            if place == 4:  # last in the shape: unsqueeze gives stride 1, inside every sized letter
                assert read(given) is None, (allocated, axes, stride)


@pytest.mark.parametrize("sizes", [(2, 4, 2, 8), (1, 4, 2, 8), (2, 4, 1, 8), (2, 1, 2, 8), (2, 4, 2, 1)])
def test_a_single_block_reads_the_same_whatever_stride_its_b_was_given(sizes):
    """A ``B`` of size 1 has no block stride: numpy's ``newaxis`` gives it 0, ``as_strided``
    anything. In every allocation order of the sized letters, a stride that puts it last
    (inside the tokens and channels: stride 0 was refused) reads as ``unsqueeze`` makes it
    (the same physical order of the sized letters, the same region, or the same refusal),
    and a receive into it writes exactly the truth."""
    import itertools

    import kvhost
    from kvhost.testing import ReceiveCase

    k, n, h, c = sizes
    accepted = 0
    for allocated in map("".join, itertools.permutations("KNHC")):
        size = dict(K=k, N=n, H=h, C=c)
        base = torch.zeros([size[a] for a in allocated]).permute([allocated.index(a) for a in "KNHC"])

        def read(stride: int, base: torch.Tensor = base) -> tuple[str, int] | None:
            shape, strides = list(base.shape), list(base.stride())
            tensor = base.as_strided([shape[0], 1, *shape[1:]], [strides[0], stride, *strides[1:]])
            try:
                layout = Layout.of(tensor, "KBNHC")
            except kvhost.LayoutError:
                return None
            return "".join(a for a in layout.physical if a == "B" or layout.size(a) > 1), layout.region_bytes

        unsqueezed = base.unsqueeze(1).stride()[1]
        for stride in (0, 1):  # strides that put it last, inside the tokens and channels
            assert read(stride) == read(unsqueezed), (allocated, stride)
        outermost = read(1 << 20)  # a stride that puts it first reads as allocated first: valid too
        assert outermost is not None and outermost[0].startswith("B"), (allocated, outermost)
        accepted += read(0) is not None
    assert accepted >= 6  # at least every order with the tokens outside the channels
    cache = torch.from_numpy(torch.zeros(2, 8, 2, 4).numpy()[:, None])  # K, (B), N, H, C: B's stride 0
    assert cache.stride()[1] == 0
    case = ReceiveCase({"l": cache}, "KBNHC", seed=5)
    case.send("one", [0], "HNC", 4)
    kvhost.receive({"l": cache}, {"one": [0]}, axes="KBNHC", remote_order="HNC", remote_block_size=4)
    case.check()


def test_a_layout_describes_the_tensors_of_its_shape_strides_item_size_and_names():
    tensor = fill_random(make_cache("KBNHC", "KBNHC", dict(K=2, B=8, N=8, H=2, C=4)), 1)
    layout = Layout.of(tensor, "KBNHC")
    assert layout.describes(tensor, "KBNHC") and layout.describes(torch.zeros_like(tensor), "KBNHC")
    assert not layout.describes(tensor, "KBNCH")  # the same dims, named otherwise
    assert not layout.describes(tensor[:, :6], "KBNHC")  # the same strides, fewer blocks
    assert not layout.describes(tensor.transpose(3, 4).contiguous().transpose(3, 4), "KBNHC")  # other strides
    assert layout.describes(tensor.view(torch.float16), "KBNHC")  # another dtype of its item size: bytes alike
    assert not layout.describes(tensor.float(), "KBNHC")  # another item size
    assert not layout.describes(torch._neg_view(tensor), "KBNHC")  # its bytes are not its values
