"""Where numba keeps the CPU kernels it compiled, when neither of its own places can be written.

numba caches a ``cache=True`` function beside its source file, else under the user's cache
directory. In a read-only image whose home is read-only too it finds neither, and every
such decorator raises at import: the CPU backend would fall back to torch ops (about a
third of the kernels' speed) for want of a directory. Then the kernels are cached in a
directory of this user's own under the temporary directory. numba loads what it finds
there, so the directory is taken only where it is this user's and no one else can write
into it; otherwise the import fails as it would have, naming why (numba cannot run a
``cache=True`` kernel uncached).
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from typing import Any

import numba
from numba.core import config


def private_cache_dir(parent: str | None = None) -> str:
    """A directory for numba's cache that only this user can write: made mode 0700 under
    ``parent`` (the temporary directory), or found there already so. Raises RuntimeError
    naming what is wrong where it is not (another owner, a link, others may write)."""
    parent = tempfile.gettempdir() if parent is None else parent
    path = os.path.join(parent, f"kvhost-numba-{os.getuid()}")
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode):
        raise RuntimeError(f"{path} is not a directory (a link or a file): not taken for numba's cache")
    if info.st_uid != os.getuid():
        raise RuntimeError(f"{path} belongs to uid {info.st_uid}, not this user's {os.getuid()}: not taken")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise RuntimeError(f"{path} may be written by others (mode {stat.S_IMODE(info.st_mode):o}): not taken")
    return path


def ensure_writable_cache(probe_source: str) -> None:
    """Before the kernels are decorated: where numba finds no place to cache a function of
    ``probe_source`` (a module's ``__file__``), point it at ``private_cache_dir``."""
    if config.CACHE_DIR:  # type: ignore[attr-defined]  # numba's settings, made at import
        return
    # A function numba takes for one of ``probe_source``'s: decorating it (nothing compiles)
    # looks for a cache place as the kernels' decorators will.
    namespace: dict[str, Any] = {}
    exec(compile("def probe():\n    return 0\n", probe_source, "exec"), namespace)
    try:
        numba.njit(cache=True)(namespace["probe"])
    except RuntimeError as err:
        if "no locator available" not in str(err):
            raise
        config.CACHE_DIR = private_cache_dir()  # type: ignore[attr-defined]  # read when a locator is sought
