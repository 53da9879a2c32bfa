"""What a new user meets first: the license the metadata names, and one line on stderr while numba
compiles the loops from an empty cache (and nothing once they are cached)."""

import re
import subprocess
import sys

from conftest import REPO

from epsim.model.compiled import COMPILE_NOTICE


def test_the_license_file_is_the_apache_2_text_the_metadata_names():
    # (a regex, not tomllib: Python 3.10 has none)
    meta = re.search(r'^license = "([^"]*)"$', (REPO / "pyproject.toml").read_text(), re.M)
    assert meta is not None and meta.group(1) == "Apache-2.0"
    text = (REPO / "LICENSE").read_text()
    assert text.split()[:4] == ["Apache", "License", "Version", "2.0,"]
    # the whole standard text: the nine sections and the appendix, not a stub
    for heading in ("1. Definitions.", "4. Redistribution.", "9. Accepting Warranty or Additional "
                    "Liability.", "END OF TERMS AND CONDITIONS", "APPENDIX: How to apply"):
        assert heading in text, heading
    assert len(text) > 11000


_PROBE = """
import numpy as np
from epsim.sim.serving.loop_kernels import release
held, used = np.array([3, 4, 5]), np.array([7, 5])
release(np.array([0, 2]), np.array([0, 0, 1]), held, used)
print(held.tolist(), used.tolist())
"""


def test_the_first_compile_says_so_once_and_a_cached_run_says_nothing(tmp_path):
    cache = tmp_path / "numba"
    env = {"NUMBA_CACHE_DIR": str(cache), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}

    def probe():
        return subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                              env=env, timeout=120)

    cold, warm = probe(), probe()
    for run in (cold, warm):
        assert run.returncode == 0, run.stderr
        assert run.stdout == "[0, 4, 0] [4, 0]\n"  # what the compiled pass computed
    assert cold.stderr.splitlines() == [COMPILE_NOTICE.format(where=cache)]
    assert warm.stderr == ""
    assert any(cache.iterdir())  # the cache the second run loaded
