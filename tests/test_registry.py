"""Backend lookup: by device type, through entry points, lazily, with KVHOST_BACKEND."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import kvhost
from kvhost.registry import registry


@pytest.fixture(autouse=True)
def fresh_choices():
    registry.clear()
    yield
    registry.clear()


def test_cpu_tensors_get_the_cpu_backend():
    assert kvhost.get_backend("cpu").name == "cpu"
    assert kvhost.get_backend(torch.zeros(1)).name == "cpu"
    assert kvhost.get_backend(torch.device("cpu")) is kvhost.get_backend("cpu")  # cached


def test_unknown_device_types_fall_back_to_the_torch_backend():
    assert kvhost.get_backend("meta").name == "torch"


def test_env_override(monkeypatch):
    monkeypatch.setenv("KVHOST_BACKEND", "torch")
    assert kvhost.get_backend("cpu").name == "torch"
    monkeypatch.setenv("KVHOST_BACKEND", "nonesuch")
    with pytest.raises(kvhost.BackendError, match="KVHOST_BACKEND='nonesuch' names no registered backend"):
        kvhost.get_backend("cpu")


def test_override_that_does_not_serve_the_device_is_ignored_for_it(monkeypatch):
    monkeypatch.setenv("KVHOST_BACKEND", "cpu")
    assert kvhost.get_backend("meta").name == "torch"


def test_named_backend_must_serve_the_device():
    with pytest.raises(kvhost.BackendError, match="'cpu' does not serve device type 'meta'"):
        kvhost.get_backend("meta", name="cpu")


def test_entry_points_list_every_in_tree_backend():
    names = {row.name for row in registry.info()}
    assert {"cpu", "torch", "cuda", "xpu", "tpu"} <= names


def test_unavailable_backends_say_why():
    rows = {row.name: row for row in registry.info()}
    if not torch.cuda.is_available() and "cuda" in rows and rows["cuda"].device_types:
        assert rows["cuda"].unavailable == "no CUDA device"
    assert rows["cpu"].available


def test_importing_kvhost_imports_no_device_stack():
    code = (
        "import sys, kvhost, torch\n"
        "kvhost.get_backend('cpu')\n"
        "kvhost.receive({'l': torch.zeros(2, 4, 8, 2, 4)}, {'r': [1]}, axes='KBNHC', remote_order='NHC')\n"
        "heavy = [m for m in ('torch_xla', 'triton', 'nixl', 'nixl_cu12', 'intel_extension_for_pytorch',"
        " 'numba', 'matplotlib') if m in sys.modules]\n"
        "print(heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_cli_info_prints_the_table_and_choice():
    out = subprocess.run(
        [sys.executable, "-m", "kvhost_tools.cli", "info"], capture_output=True, text=True, check=True
    ).stdout
    assert "cpu" in out and "torch" in out and "available" in out
    assert "cpu        -> cpu" in out
