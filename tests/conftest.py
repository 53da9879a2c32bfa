import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
#: real DeepSeek-V3 expert loads, read from ../shared (never copied into the project)
SHARED_LOADS = REPO.parent / "shared" / "data" / "expert_loads"


def run_epsim(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run ``python -m epsim`` as a user would, from the repository root."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "epsim", *args], capture_output=True, text=True,
                          cwd=REPO, env=env, timeout=timeout)


@pytest.fixture
def epsim():
    return run_epsim


@pytest.fixture
def shared_loads() -> Path:
    if not SHARED_LOADS.is_dir():
        pytest.fail(f"shared expert loads not found at {SHARED_LOADS}")
    return SHARED_LOADS
