import json

import pytest

from epsim.model.placement import read_placement


def test_balance_json_keys_and_placement_file(epsim, tmp_path):
    out = tmp_path / "placement.json"
    r = epsim("balance", "--loads", "decode_in2000out100", "--gpus", "8",
              "--eval", "decode_in1000out1000", "--out", str(out),
              "--json")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["layers"] == 58
    for key in ("imbalance_before", "imbalance_after", "lower_bound"):
        assert set(report[key]) == {"mean", "max"}
    assert 1.7 < report["imbalance_before"]["mean"] < 2.2  # contiguous
    assert report["imbalance_after"]["mean"] <= 1.0001
    assert report["imbalance_after"]["max"] <= 1.0005
    assert set(report["eval"]) == {"imbalance_before", "imbalance_after"}
    assert report["eval"]["imbalance_after"]["mean"] < report["eval"]["imbalance_before"]["mean"]
    assert report["wall_ms"] > 0 and "moved_experts" not in report
    placement = read_placement(out, num_layers=61, num_experts=256)
    assert placement.slots_per_gpu == 32

    # rebalancing on other loads from that placement, at most 8 experts off their GPU
    r = epsim("balance", "--loads", "decode_in1000out1000",
              "--gpus", "8", "--previous", str(out), "--max-moves", "8", "--json")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["before"] == "previous"
    assert 0 < report["moved_experts"] <= 8 * 58 and report["moved_experts_max_layer"] <= 8
    assert report["imbalance_after"]["mean"] < report["imbalance_before"]["mean"]


def test_balance_replicas_and_nodes_text(epsim):
    r = epsim("balance", "--loads", "prefill_in4096", "--gpus", "8",
              "--redundant", "32", "--nodes", "2", "--expert-groups", "8")
    assert r.returncode == 0, r.stderr
    assert "8 GPUs x 36 slots" in r.stdout and "lower bound" in r.stdout


@pytest.mark.parametrize("content, message", [
    ("{", "malformed JSON"),
    ('{"counts": [[1, 2]]}', "logical_count"),
    ('{"logical_count": [[1, 2], [3]]}', "rectangular"),
    ('{"logical_count": [1, 2, 3]}', "layers"),
    ('{"logical_count": [[1, 2, 3], [4, 5, 6]]}', "do not divide"),  # 3 experts on 2 GPUs
    ('{"logical_count": [[0, 0], [0, 0]]}', "all zeros"),
])
def test_bad_load_files_exit_2(epsim, tmp_path, content, message):
    path = tmp_path / "loads.json"
    path.write_text(content)
    r = epsim("balance", "--loads", str(path), "--gpus", "2")
    assert r.returncode == 2
    assert r.stdout == ""
    assert len(r.stderr.strip().splitlines()) == 1 and message in r.stderr


def test_eval_file_of_another_shape_exits_2(epsim, tmp_path):
    path = tmp_path / "small.json"
    path.write_text(json.dumps({"logical_count": [[1] * 16] * 61}))
    r = epsim("balance", "--loads", "prefill_in2048", "--gpus", "8",
              "--eval", str(path))
    assert r.returncode == 2 and "do not match" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    r = epsim("balance", "--loads", str(tmp_path / "missing.json"), "--gpus", "8")
    assert r.returncode == 2 and "unknown load file" in r.stderr
    r = epsim("balance", "--loads", str(path), "--gpus", "8", "--max-moves", "3")
    assert r.returncode == 2 and "previous" in r.stderr
