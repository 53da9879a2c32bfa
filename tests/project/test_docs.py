"""Docs that are generated from the code's own data stay in step with it."""

import subprocess
import sys

from conftest import REPO


def test_the_hardware_tables_are_generated_from_the_profiles():
    r = subprocess.run([sys.executable, "tools/hardware_doc.py", "--check"], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
