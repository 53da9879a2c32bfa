"""``epsim run`` as users call it: one JSON object, one-line errors, torch optional."""

import json
import subprocess
import sys

import pytest
from cli.test_without_torch import run_without_torch

from epsim.model.placement import contiguous_placement

RUN = ["run", "--model", "tiny-deepseek", "--batch", "2", "--context", "4", "--steps", "2"]


def test_json_has_the_promised_keys_and_checks_against_the_reference(epsim, tmp_path):
    pytest.importorskip("torch")
    trace = tmp_path / "trace.json"
    out = epsim(*RUN, "--world-size", "2", "--static", "--check", "--trace", str(trace),
                "--json", timeout=90)
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout)  # exactly one object on stdout
    assert set(summary["step_ms"]) == {"mean", "median", "p10", "p90"}
    assert summary["step_ms"]["p10"] <= summary["step_ms"]["median"] <= summary["step_ms"]["p90"]
    # tokens/s: every rank's sequences over the mean step
    assert summary["tokens_per_s"] == pytest.approx(2 * 2 / (summary["step_ms"]["mean"] / 1e3))
    assert summary["max_rel_err"] < 1e-4
    # the runtime runs no hardware profile: the version alone (docs/provenance.md)
    import epsim as package

    assert summary["provenance"]["epsim_version"] == package.__version__
    assert summary["provenance"]["hardware_profile"] is None
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in events} == {0, 1}
    assert any(e["name"] == "L1.moe.dispatch.mb0" and e["tid"] == 1 for e in events)


def test_redundant_experts_are_balanced_and_checked_against_the_reference(epsim):
    pytest.importorskip("torch")
    out = epsim(*RUN, "--world-size", "2", "--redundant-experts", "2", "--check", "--json",
                timeout=90)
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout)
    assert summary["redundant_experts"] == 2
    assert summary["placement"] == "balanced from synthetic loads"
    assert summary["max_rel_err"] < 1e-4 and summary["token_mismatches"] == 0


def test_a_relative_placement_path_is_the_users_not_the_ranks(tmp_path):
    # the ranks run in their own folder: the parent makes the path absolute before they start
    pytest.importorskip("torch")
    (tmp_path / "plans").mkdir()
    placement = tmp_path / "plans" / "p.json"
    placement.write_text(json.dumps(contiguous_placement(3, 16, 2).to_json()))
    out = subprocess.run([sys.executable, "-m", "epsim", *RUN, "--world-size", "2",
                          "--placement", "plans/p.json", "--json"],
                         capture_output=True, text=True, cwd=tmp_path, timeout=90)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["placement"] == str(placement)


@pytest.mark.parametrize("args, message", [
    (["--capture"], "graph capture needs a GPU"),
    (["--tp", "2"], "tp = 1"),
    (["--placement", "/nonexistent/p.json"], "placement file not found"),
    (["--dbo", "--batch", "1"], "--dbo splits the batch"),
    (["--model", "deepseek-x"], "unknown model"),
    (["--world-size", "3"], "ep 3 does not divide the 16 experts"),
    (["--world-size", "4", "--redundant-experts", "2"],
     "ep 4 does not divide the 16 experts + 2 redundant = 18 expert slots"),
    (["--loads", "decode_in2000out100"], "do not match tiny-deepseek's [3, 16]"),
    (["--trace", "/nonexistent/dir/t.json"], "does not exist"),
    # tiny-deepseek's max_position_embeddings is 4096: the last step would attend 4097 tokens
    (["--context", "4090", "--steps", "8"], "--context 4090 + --steps 8 - 1: 4097 tokens exceed "
     "tiny-deepseek's context of 4096 tokens (max_position_embeddings"),
])
def test_bad_input_is_one_line_and_exit_2(epsim, args, message):
    pytest.importorskip("torch")
    out = epsim(*RUN, *args)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], out.stderr
    assert out.stdout == ""


def test_without_torch_run_says_so_and_other_commands_work():
    # torch blocked the way tests/cli/test_without_torch.py blocks it (an import hook)
    out = run_without_torch(*RUN)
    assert out.returncode == 2
    assert out.stderr.strip() == ("epsim run: error: epsim run needs torch: pip install "
                                  "'epsim[runtime]' (CPU: first pip install torch==2.13.0)")
    assert run_without_torch("--help").returncode == 0
    described = run_without_torch("describe", "--model", "tiny-deepseek", "--json")
    assert described.returncode == 0, described.stderr
    assert json.loads(described.stdout)["experts"] == 16


def test_gpu_decode_step_script_runs_its_cpu_path_and_says_it_needs_a_gpu():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the script runs for real (bench, not a test)")
    import subprocess
    import sys

    from conftest import REPO

    out = subprocess.run([sys.executable, "bench/gpu_decode_step.py", "--steps", "2"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert out.stdout.startswith("CPU self-check (static eager")
    assert out.stderr.strip() == ("gpu_decode_step: no CUDA/ROCm device: the captured step "
                                  "needs a GPU")


def test_options_up_to_the_context_limit_validate():
    from epsim.model.errors import EpsimError
    from epsim.runtime.options import RunOptions, validate
    opts = RunOptions(model="tiny-deepseek", world_size=2, batch=2, context=4090, steps=7)
    model, _, _ = validate(opts)  # the last step attends 4096 tokens: exactly the limit
    assert model.max_position_embeddings == 4096
    with pytest.raises(EpsimError, match="4097 tokens exceed"):
        validate(opts.with_(steps=8))
