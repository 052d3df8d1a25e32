"""The CPU kernels where numba can cache them neither beside their source nor in the user's
cache directory (a read-only image with a read-only home): a private directory under the
temporary directory serves, and only one that no one else can write into."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("numba")
from kvhost_cpu.cache_dir import private_cache_dir

ROOT = Path(__file__).resolve().parent.parent

# numba as it is in a read-only install with a read-only home: of its places to cache, only
# the one an operator names (NUMBA_CACHE_DIR) is left, and none is named.
READ_ONLY = """
from numba.core import caching
caching.CacheImpl._locator_classes = [caching.UserProvidedCacheLocator]
"""


def run(code: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    env.update(TMPDIR=str(tmp_path), PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "backends")]))
    script = textwrap.dedent(READ_ONLY) + textwrap.dedent(code)
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)


def test_kernels_load_and_cache_in_a_private_directory_where_numba_has_no_place(tmp_path):
    done = run(
        """
        import numba, kvhost_cpu.kernels
        from kvhost_cpu.backend import KERNELS
        print(numba.config.CACHE_DIR)
        print(KERNELS.module is kvhost_cpu.kernels, repr(KERNELS.reason))
        """,
        tmp_path,
    )
    assert done.returncode == 0, done.stderr
    place, loaded = done.stdout.split("\n")[:2]
    assert place == str(tmp_path / f"kvhost-numba-{os.getuid()}") and loaded == "True ''"
    assert (os.stat(place).st_mode & 0o777) == 0o700


def test_without_the_private_directory_the_kernels_would_not_load(tmp_path):
    """The simulation is the failure it stands for: numba refuses the first kernel."""
    done = run(
        """
        import kvhost_cpu.cache_dir as cache_dir
        cache_dir.ensure_writable_cache = lambda source: None
        from kvhost_cpu.backend import KERNELS
        print(KERNELS.module, KERNELS.reason)
        """,
        tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("None ") and "no locator available" in done.stdout


def test_a_directory_others_could_write_into_is_not_taken(tmp_path):
    """numba loads what it finds in its cache: a directory another user made, or may write
    into, or a link to one, could hand it code. The kernels then fail to load, naming why."""
    path = tmp_path / f"kvhost-numba-{os.getuid()}"
    made = private_cache_dir(str(tmp_path))
    assert made == str(path) and (path.stat().st_mode & 0o777) == 0o700
    assert private_cache_dir(str(tmp_path)) == made  # found again, as it was left
    path.chmod(0o777)
    with pytest.raises(RuntimeError, match=r"may be written by others \(mode 777\): not taken"):
        private_cache_dir(str(tmp_path))
    path.rmdir()
    path.symlink_to(tmp_path)
    with pytest.raises(RuntimeError, match=r"is not a directory .*: not taken"):
        private_cache_dir(str(tmp_path))
    path.unlink()
    path.write_text("")
    with pytest.raises(RuntimeError, match="is not a directory"):
        private_cache_dir(str(tmp_path))
    path.unlink()
    if os.getuid() == 0:  # root can make it another user's
        path.mkdir(mode=0o700)
        os.chown(path, 65534, 65534)
        with pytest.raises(RuntimeError, match=r"belongs to uid 65534, not this user's 0: not taken"):
            private_cache_dir(str(tmp_path))
    path.parent.joinpath("other").mkdir()
    done = run(
        """
        import os
        place = os.path.join(os.environ["TMPDIR"], f"kvhost-numba-{os.getuid()}")
        os.mkdir(place)
        os.chmod(place, 0o777)
        from kvhost_cpu.backend import KERNELS
        print(KERNELS.module, KERNELS.reason)
        """,
        tmp_path / "other",
    )
    assert done.stdout.startswith("None ") and "may be written by others" in done.stdout, done.stderr


def test_the_private_directory_is_taken_only_where_numba_finds_no_place(monkeypatch, tmp_path):
    """In this process, as the kernels' import asks it: an operator's NUMBA_CACHE_DIR is kept,
    a place numba has (beside the source) is kept, none gives the private directory, and any
    other refusal of numba's is raised as it came."""
    import tempfile

    import kvhost_cpu.kernels as kernels
    import numba
    from kvhost_cpu.cache_dir import ensure_writable_cache
    from numba.core import caching, config

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    # An operator's choice, even one numba cannot use: numba then names it, not kvhost's place.
    monkeypatch.setattr(config, "CACHE_DIR", "/dev/null/numba")
    monkeypatch.setattr(caching.CacheImpl, "_locator_classes", [caching.UserProvidedCacheLocator])
    ensure_writable_cache(kernels.__file__)
    assert config.CACHE_DIR == "/dev/null/numba"
    monkeypatch.setattr(config, "CACHE_DIR", "")
    ensure_writable_cache(kernels.__file__)
    place = str(tmp_path / f"kvhost-numba-{os.getuid()}")
    assert place == config.CACHE_DIR
    monkeypatch.undo()
    monkeypatch.setattr(config, "CACHE_DIR", "")
    ensure_writable_cache(kernels.__file__)  # beside the source, as numba found it
    assert config.CACHE_DIR == ""

    def refuses(*args, **kwargs):
        raise RuntimeError("numba says something else")

    monkeypatch.setattr(numba, "njit", lambda **options: refuses)
    with pytest.raises(RuntimeError, match="numba says something else"):
        ensure_writable_cache(kernels.__file__)
