"""numba's cache of the compiled loops lives in the user's cache folder, never beside the
module: a ``pip install .`` must leave nothing inside ``site-packages/epsim/`` that an uninstall
would leave behind (``epsim.model.compiled``)."""

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("numba")

MODULE = textwrap.dedent("""
    from epsim.model.compiled import compiled

    @compiled
    def twice(x):
        return 2 * x
""")
RUN = textwrap.dedent("""
    import loop  # from the working folder, which python -c puts first on its path
    assert loop.twice(21) == 42
    print(getattr(loop.twice._cache, "cache_path", "no cache"))
""")


def _run(tmp_path, **env):
    (tmp_path / "src").mkdir(exist_ok=True)
    (tmp_path / "src" / "loop.py").write_text(MODULE)
    clean = {k: v for k, v in os.environ.items() if k not in ("NUMBA_CACHE_DIR", "XDG_CACHE_HOME")}
    r = subprocess.run([sys.executable, "-c", RUN], capture_output=True, text=True,
                       env={**clean, **env}, cwd=tmp_path / "src")
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def _cache_files(folder):
    return sorted(p.name for p in folder.rglob("*") if p.suffix in (".nbi", ".nbc"))


def test_the_cache_goes_to_the_user_cache_folder_not_beside_the_module(tmp_path):
    home = tmp_path / "xdg"
    where = _run(tmp_path, XDG_CACHE_HOME=str(home))
    assert where.startswith(str(home / "epsim" / "numba"))
    assert _cache_files(home) and not _cache_files(tmp_path / "src")
    # a second process loads what the first wrote (same files, nothing new)
    before = _cache_files(home)
    _run(tmp_path, XDG_CACHE_HOME=str(home))
    assert _cache_files(home) == before


def test_a_user_set_numba_cache_dir_wins(tmp_path):
    mine = tmp_path / "mine"
    where = _run(tmp_path, NUMBA_CACHE_DIR=str(mine), XDG_CACHE_HOME=str(tmp_path / "xdg"))
    assert where.startswith(str(mine)) and not (tmp_path / "xdg").exists()


def test_no_writable_cache_folder_means_no_cache_not_one_in_the_package(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")  # a cache home under a file can never be made
    where = _run(tmp_path, XDG_CACHE_HOME=str(blocker / "cache"))
    assert where == "no cache" or "__pycache__" not in where
    assert not _cache_files(tmp_path)
