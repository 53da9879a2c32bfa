"""numba compilation shared by the compiled loops (``model/eplb/kernels*.py``,
``sim/step/executor/walk.py``, ``sim/step/routing.py``, ``sim/serving/loop_kernels.py``).

    numba      the module, or None where it is not installed (every caller then runs the same
               source as Python)
    compiled   the decorator: ``njit(cache=True)`` with the cache in the user's cache folder,
               compiled per process where that folder cannot be written
    cache_dir  that folder: ``$NUMBA_CACHE_DIR`` where the user set it, else
               ``<platform cache folder>/epsim/numba`` (``$XDG_CACHE_HOME`` or ``~/.cache`` on
               Linux, ``~/Library/Caches`` on macOS, ``%LOCALAPPDATA%`` on Windows)

Why not numba's default: it writes beside the module where that folder is writable, which for
``pip install .`` is inside ``site-packages/epsim/``. Those files are no part of the install, so
uninstalling leaves them (and the folder) behind, and the leftover ``epsim/`` folder then
shadows an editable install of the same package in new processes. So the cache never goes into
the package: one folder per user, a sub-folder per installed copy (numba names it by the source
path), and none at all when no such folder can be written.

The first compile of an epsim loop in a process (a cold cache: a fresh install, a new version)
prints one line on stderr, :data:`COMPILE_NOTICE`, so a first run's silent ~20 s has a reason on
the terminal; a warm cache prints nothing. Only the command's own process says it: pool workers
compiling at once would repeat it.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

try:  # numba compiles the loops; without it the same code runs as Python (equal results)
    import numba
    from numba.core import config as _numba_config
    from numba.core import event as _numba_event
except ImportError:  # pragma: no cover - numba is a dependency; this keeps a broken install usable
    numba = None
    _numba_config = None
    _numba_event = None

#: what the first compile of an epsim loop in a process prints on stderr. The ~20 s: the README's
#: first command (``predict``) took 18 s more from an empty cache in a fresh clone (issue 31),
#: 12.3 s of CPU time against 1.6 s with the cache on a 2-core machine (README)
COMPILE_NOTICE = "epsim: compiling kernels, once, ~20 s (cached in {where})"
#: the same where no cache folder can be written: every process compiles again
COMPILE_NOTICE_NO_CACHE = "epsim: compiling kernels, ~20 s (no writable cache folder: every run)"


def _platform_cache_home() -> Path:
    """The user's cache folder by the platform's convention."""
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Caches"
    if os.name == "nt":
        return Path(os.environ.get("LOCALAPPDATA") or Path.home() / "AppData" / "Local")
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")


def cache_dir() -> Path | None:
    """Where compiled loops are cached (module docstring), None where it cannot be written."""
    given = os.environ.get("NUMBA_CACHE_DIR")
    folder = Path(given) if given else _platform_cache_home() / "epsim" / "numba"
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    return folder if os.access(folder, os.W_OK | os.X_OK) else None


def compiled(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` compiled by numba and cached in :func:`cache_dir`, compiled per process where
    there is none; ``fn`` itself without numba (``fn.py_func`` is the Python function either
    way)."""
    if numba is None:  # pragma: no cover
        fn.py_func = fn
        return fn
    folder = cache_dir()
    if folder is None:  # a read-only home: no cache rather than one inside the package
        return numba.njit(fn)
    # numba reads its cache folder when the decorator makes the function's cache (its locator
    # keeps the path): set it for this function alone and leave the user's setting as it was
    before = _numba_config.CACHE_DIR
    _numba_config.CACHE_DIR = str(folder)
    try:
        return numba.njit(cache=True)(fn)
    except RuntimeError:  # "cannot cache function ...: no locator available"
        return numba.njit(fn)
    finally:
        _numba_config.CACHE_DIR = before


if _numba_event is not None:
    class _FirstCompile(_numba_event.Listener):
        """Prints :data:`COMPILE_NOTICE` when numba starts compiling an epsim function (it found
        no cached copy) for the first time in the command's own process."""

        def __init__(self) -> None:
            self.announced = False

        def on_start(self, event: Any) -> None:
            if self.announced or multiprocessing.parent_process() is not None:
                return
            fn = getattr(event.data.get("dispatcher"), "py_func", None)
            if not getattr(fn, "__module__", "").startswith("epsim."):
                return
            self.announced = True
            folder = cache_dir()
            line = (COMPILE_NOTICE.format(where=folder) if folder is not None
                    else COMPILE_NOTICE_NO_CACHE)
            sys.stderr.write(line + "\n")
            sys.stderr.flush()

        def on_end(self, event: Any) -> None:
            pass

    _numba_event.register("numba:compile", _FirstCompile())
