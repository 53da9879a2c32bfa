import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def run_epsim(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run ``python -m epsim`` of the installed package as a user would, from the repository
    root (relative paths in ``args`` are relative to it)."""
    return subprocess.run([sys.executable, "-m", "epsim", *args], capture_output=True, text=True,
                          cwd=REPO, timeout=timeout)


@pytest.fixture
def epsim():
    return run_epsim
