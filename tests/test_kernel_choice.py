"""The kernel-technology experiment (experiments/cpu_kernel_choice) still builds, and its
C++ kernel leaves exactly the bytes the shipped numba kernel leaves."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest

pytest.importorskip("numba")
if shutil.which("g++") is None:
    pytest.skip("g++ not found: the experiment compiles C++", allow_module_level=True)

SCRIPT = Path(__file__).parents[1] / "experiments" / "cpu_kernel_choice" / "compare.py"


def load_experiment():
    spec = importlib.util.spec_from_file_location("kernel_choice", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cxx_and_numba_kernels_agree_and_are_timed():
    experiment = load_experiment()
    rows = experiment.compare(quick=True, requests=[2])  # raises if the two kernels' bytes differ
    assert [row["workload"] for row in rows] == ["receive-r4", "receive-g4"]
    for row in rows:
        assert set(row["median_s"]) == set(experiment.METHODS)
        assert all(seconds > 0 for seconds in row["median_s"].values())


def test_the_agreement_check_can_fail():
    experiment = load_experiment()
    import torch

    caches = {"l": torch.zeros(2, 4, 8, dtype=torch.int16)}

    def scramble():
        caches["l"][0] += 1

    assert experiment.same_bytes(caches, scramble, scramble)
    assert not experiment.same_bytes(caches, scramble, lambda: None)
    assert not experiment.same_bytes(caches, lambda: None, lambda: None)  # a no-op proves nothing
