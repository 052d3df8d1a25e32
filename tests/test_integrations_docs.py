"""The Python blocks of the integration and plugin docs run as written.

Each document's blocks run in order, in one namespace per document, so the docs cannot
drift from the code they describe.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "gaudi_style_plugin"
DOCS = [ROOT / "docs" / "integrations.md", ROOT / "docs" / "plugins.md", EXAMPLE / "README.md"]


@pytest.mark.parametrize("document", DOCS, ids=lambda path: str(path.relative_to(ROOT)))
def test_python_blocks_run(document, monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLE))  # the example's README imports its package
    monkeypatch.delenv("KVHOST_BACKEND", raising=False)
    blocks = re.findall(r"```python\n(.*?)```", document.read_text(), flags=re.S)
    assert blocks, f"{document} has no python block"
    namespace: dict[str, object] = {"__name__": "docs"}
    for block in blocks:
        exec(compile(block, str(document), "exec"), namespace)


def test_importing_kvhost_and_its_vllm_adapter_never_imports_vllm():
    """Only vLLM loads kvhost.integrations.vllm_connector (kv_connector_module_path)."""
    import subprocess
    import sys

    code = "import sys, kvhost, kvhost.integrations.vllm; assert 'vllm' not in sys.modules, 'vllm imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
