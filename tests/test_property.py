"""Property test: random layouts, sizes, remote specs and id sets against the oracle."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvhost
from kvhost.testing import ReceiveCase, make_cache

DTYPES = [torch.bfloat16, torch.float32, torch.uint8, torch.float8_e5m2]


@st.composite
def scenarios(draw):
    optional = draw(st.lists(st.sampled_from("LKH"), unique=True))
    outer = draw(st.permutations([a for a in optional if draw(st.booleans())]))
    region = draw(st.permutations(["N", "C", *[a for a in optional if a not in outer]]))
    physical = "".join(outer) + "B" + "".join(region)
    axes = "".join(draw(st.permutations(list(physical))))
    sizes = {
        "B": draw(st.integers(4, 10)),
        "N": draw(st.sampled_from([2, 4, 8])),
        "C": draw(st.integers(1, 5)),
        "H": draw(st.integers(1, 3)),
        "K": 2,
        "L": draw(st.integers(1, 3)),
    }
    n = sizes["N"]
    remote = draw(st.sampled_from([n // d for d in (1, 2, 4, 8) if n % d == 0] + [2 * n, 4 * n]))
    remote_order = "".join(draw(st.permutations(list(region))))
    g = max(remote // n, 1)
    blocks = draw(st.permutations(range(sizes["B"])))
    # Every request names blocks (whole groups of g), the first always fits (B >= 4 >= g): a
    # case that names none would test nothing.
    counts = draw(st.lists(st.integers(1, 3), min_size=1, max_size=4))
    requests, at = {}, 0
    for i, groups in enumerate(counts):
        take = min(groups, (len(blocks) - at) // g) * g
        if not take:
            break
        requests[f"r{i}"] = list(blocks[at : at + take])
        at += take
    dtype = draw(st.sampled_from(DTYPES))
    layers = draw(st.integers(1, 2))
    return axes, physical, {a: sizes[a] for a in physical}, remote, remote_order, requests, dtype, layers


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario=scenarios())
def test_random_layouts_match_the_oracle(backend, scenario):
    axes, physical, sizes, remote, remote_order, requests, dtype, layers = scenario
    caches = {f"l{i}": make_cache(axes, physical, sizes, dtype) for i in range(layers)}
    case = ReceiveCase(caches, axes, seed=len(requests))
    for name, ids in requests.items():
        case.send(name, ids, remote_order, remote)
    kvhost.receive(caches, requests, axes=axes, remote_order=remote_order, remote_block_size=remote, backend=backend)
    case.check()


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@settings(max_examples=40, deadline=None)
@given(
    data=st.data(),
    src_physical=st.permutations(list("NHC")),
    dst_physical=st.permutations(list("NHC")),
    k_outer=st.booleans(),
)
def test_random_copies_match_the_oracle(backend, data, src_physical, dst_physical, k_outer):
    from kvhost.testing import CopyCase, fill_random

    sizes = dict(K=2, B=9, N=4, H=2, C=3)
    src_phys = ("KB" if k_outer else "BK") + "".join(src_physical)
    dst_phys = "KB" + "".join(dst_physical)
    src = {"l": fill_random(make_cache("KBNHC", src_phys, sizes), 1)}
    dst = {"l": fill_random(make_cache("KBNHC", dst_phys, sizes), 2)}
    case = CopyCase(src, dst, "KBNHC", "KBNHC")
    src_ids = data.draw(st.lists(st.integers(0, 8), min_size=1, max_size=9))  # an empty copy tests nothing
    dst_ids = data.draw(st.permutations(range(9)))[: len(src_ids)]
    kvhost.copy_blocks(src, dst, src_ids, dst_ids, axes="KBNHC", backend=backend)
    case.check(src_ids, dst_ids)
