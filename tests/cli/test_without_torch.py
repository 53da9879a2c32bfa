"""The model and simulator packages and the simulation commands run without torch installed."""

import json
import subprocess
import sys

from conftest import REPO

BLOCK_TORCH = """
import sys
class _NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError("No module named 'torch' (blocked by the test)")
        return None
sys.meta_path.insert(0, _NoTorch())
from epsim.cli import main
sys.exit(main(sys.argv[1:]))
"""


def run_without_torch(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCK_TORCH, *argv], capture_output=True,
                          text=True, cwd=REPO, timeout=300)


def test_describe_without_torch():
    r = run_without_torch("describe", "--model", "deepseek-r1", "--dp", "8", "--ep", "8",
                          "--hardware", "mi300x", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["per_rank"]["kv_capacity_tokens"] > 0


def test_help_lists_every_command_without_torch():
    r = run_without_torch("--help")
    assert r.returncode == 0, r.stderr
    for command in ("describe", "step", "predict", "sweep", "tune", "plan", "balance", "run"):
        assert command in r.stdout


def test_simulation_commands_without_torch():
    step = run_without_torch("step", "--model", "deepseek-r1", "--hardware", "mi300x", "--dp", "8",
                             "--ep", "8", "--batch", "64", "--context", "1000", "--json")
    assert step.returncode == 0, step.stderr
    assert json.loads(step.stdout)["step_ms"] > 0
    predict = run_without_torch("predict", "--model", "deepseek-r1", "--hardware", "mi300x",
                                "--concurrency", "64", "--num-prompts", "64", "--isl", "200",
                                "--osl", "20", "--json")
    assert predict.returncode == 0, predict.stderr
    assert json.loads(predict.stdout)["completed"] == 64
