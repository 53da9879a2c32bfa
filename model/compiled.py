"""numba compilation shared by the compiled loops (``model/eplb/kernels*.py``, and
``sim/engine_walk.py``, which may import epsim.model).

    numba      the module, or None where it is not installed (every caller then runs the same
               source as Python)
    compiled   the decorator: ``njit(cache=True)``, falling back to a per-process compile where
               numba finds no writable cache place (a read-only install)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

try:  # numba compiles the loops; without it the same code runs as Python (equal results)
    import numba
except ImportError:  # pragma: no cover - numba is a dependency; this keeps a broken install usable
    numba = None


def compiled(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` compiled by numba, cached on disk where numba finds a writable place (beside the
    module, else its user cache), compiled per process where it finds none; ``fn`` itself
    without numba (``fn.py_func`` is the Python function either way)."""
    if numba is None:  # pragma: no cover
        fn.py_func = fn
        return fn
    try:
        return numba.njit(cache=True)(fn)
    except RuntimeError:  # "cannot cache function ...: no locator available" (read-only install)
        return numba.njit(fn)
