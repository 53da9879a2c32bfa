"""bench/bench_placement_holdout.py imports DeepSeek's eplb.py from the path given (here a
stand-in with the same entry point) and prints fitted and held-out figures beside epsim's."""

import json
import subprocess
import sys

import pytest
from conftest import REPO

pytest.importorskip("torch")

#: DeepSeek's signature and return values; every expert on the GPU of its contiguous block
FAKE_EPLB = '''
import torch

def rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_gpus):
    layers, experts = weight.shape
    assert num_replicas == experts and num_nodes == 1
    phy2log = torch.arange(experts).expand(layers, experts).clone()
    return phy2log, phy2log.unsqueeze(-1), torch.ones(layers, experts, dtype=torch.int64)
'''


def test_bench_runs_deepseek_from_a_path(tmp_path):
    fake = tmp_path / "eplb.py"
    fake.write_text(FAKE_EPLB)
    names = []
    for i, counts in enumerate(([8, 1, 1, 8, 2, 2, 2, 2], [1, 8, 8, 1, 2, 2, 2, 2],
                                [4, 4, 4, 4, 1, 1, 1, 1])):
        path = tmp_path / f"w{i}.json"
        path.write_text(json.dumps({"logical_count": [[0] * 8, counts]}))
        names.append(str(path))
    r = subprocess.run([sys.executable, "bench/bench_placement_holdout.py", "--deepseek-eplb",
                        str(fake), "--loads", ",".join(names), "--gpus", "2", "--redundant", "0",
                        "--repeats", "1"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "| fit files | cases | greedy | greedy-swap | minmax | DeepSeek EPLB |" in r.stdout
    # the stand-in keeps experts 0-3 on GPU 0: on w0 that is 18 of 26 tokens, 18 / 13
    assert "| w1 | w0 | " in r.stdout
    row = next(line for line in r.stdout.splitlines() if line.startswith("| w1 | w0 | "))
    assert row.rstrip().endswith(f"{18 / 13:.4f} |")
