"""``--kernels`` and ``--explain`` through the commands: the selected set and the fusions it
implies reach the plan, every op kind's time names its source, an unknown set is one line."""

import json
from pathlib import Path

import pytest

from epsim.cli import main
from epsim.model import Fusion, load_model, make_plan
from epsim.model.plan import with_implied_fusions

PROFILE = str(Path(__file__).resolve().parents[1] / "data" / "mi300x-kernels-test.json")
STEP = ["step", "--model", "deepseek-r1", "--hardware", PROFILE, "--dp", "8", "--ep", "8",
        "--batch", "256", "--context", "2100", "--uniform", "--no-dbo"]


def run_json(capsys, *argv: str) -> dict:
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_explain_names_a_source_for_every_op_kind(capsys):
    out = run_json(capsys, *STEP, "--explain")
    assert out["kernels"] == "synthetic" and out["plan"]["kernels"] == "synthetic"
    assert set(out["kernel_sources"]) == set(out["op_kinds_ms"])
    for kind, info in out["kernel_sources"].items():
        assert info["sources"], kind  # a table point's source, or the roofline figures' own
    # near the table's point at 256 tokens (470.75 us per layer over 58 MoE layers): uniform
    # routing is sampled, so the busiest rank computes a few more pairs than 256 x 8
    moe = out["kernel_sources"]["grouped_gemm"]
    assert set(moe["methods"]) <= {"table-exact", "table-interpolated"}
    assert out["op_kinds_ms"]["grouped_gemm"] / 58 * 1e3 == pytest.approx(470.75, rel=0.03)
    # the roofline kinds cite the profile figures their roofline uses
    assert "profile:hbm_bandwidth" in out["kernel_sources"]["norm"]["sources"]


def test_a_set_implies_its_fusions_and_none_is_the_roofline(capsys):
    fused = run_json(capsys, *STEP, "--kernels", "roofline-fast-attention")
    assert fused["plan"]["shared_expert_in_moe"] is True
    plain = run_json(capsys, *STEP, "--kernels", "none")
    assert plain["plan"]["shared_expert_in_moe"] is False and plain["kernels"] == "none"
    # the set halves decode attention's roofline time, and nothing else of the attention
    assert fused["op_kinds_ms"]["attention_decode"] == pytest.approx(
        plain["op_kinds_ms"]["attention_decode"] / 2, rel=1e-9)


def test_implied_fusions_apply_where_the_model_admits_them():
    r1, mixtral = load_model("deepseek-r1"), load_model("mixtral-8x7b")
    options = {"shared_expert_in_moe": True}
    assert with_implied_fusions(make_plan(r1), r1, options).fusion.shared_expert_in_moe
    # no shared expert: the library runs the model as before, no error
    plan = make_plan(mixtral)
    assert with_implied_fusions(plan, mixtral, options) == plan
    # tp > 1 under EP splits the tokens before dispatch: the fusion does not apply
    tp2 = make_plan(r1, dp=4, tp=2, ep=8)
    assert with_implied_fusions(tp2, r1, options).fusion == Fusion()


@pytest.mark.parametrize("argv", [
    ["step", "--model", "deepseek-r1", "--hardware", "mi300x", "--batch", "8", "--context", "64",
     "--kernels", "nosuch"],
    ["predict", "--model", "deepseek-r1", "--hardware", "mi300x", "--isl", "100", "--osl", "10",
     "--kernels", "nosuch"],
])
def test_an_unknown_kernel_set_is_one_line(argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown kernel set 'nosuch'" in err


def test_predict_echoes_the_kernel_set(capsys):
    out = run_json(capsys, "predict", "--model", "deepseek-r1", "--hardware", PROFILE,
                   "--isl", "200", "--osl", "8", "--concurrency", "16")
    assert out["kernels"] == "synthetic" and out["shared_expert_in_moe"] is False


def test_the_shipped_mi300x_step_names_a_source_for_every_op_kind(capsys):
    out = run_json(capsys, "step", "--model", "deepseek-r1", "--hardware", "mi300x", "--dp", "8",
                   "--ep", "8", "--batch", "512", "--context", "2100", "--explain")
    assert out["kernels"] == "aiter" and out["plan"]["shared_expert_in_moe"] is True
    assert set(out["kernel_sources"]) == set(out["op_kinds_ms"])
    for kind, info in out["kernel_sources"].items():
        assert info["sources"], kind
    # the fused MoE and the exchanges come from the tables, the DP-attention GEMMs outside them
    assert out["kernel_sources"]["grouped_gemm"]["methods"].keys() <= {"table-exact",
                                                                        "table-interpolated"}
    assert any(o["features"]["n"] == 24576 for o in out["kernel_sources"]["gemm"]["outside"])


def test_a_malformed_kernel_table_is_one_line_and_exit_2(tmp_path, capsys):
    profile = json.loads(Path(PROFILE).read_text())
    profile["kernels"]["sets"]["synthetic"]["tables"][0]["points"][0][5] = -1.0  # its time
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(profile))
    argv = ["step", "--model", "deepseek-r1", "--hardware", str(bad), "--batch", "8",
            "--context", "64"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "kernels" in err
