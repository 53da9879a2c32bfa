import json

import pytest

from epsim.cli import main


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_describe_json_keys(capsys):
    code, out, _ = run(capsys, "describe", "--model", "deepseek-r1", "--dp", "8", "--ep", "8",
                       "--hardware", "mi300x", "--json")
    assert code == 0
    d = json.loads(out)
    for key in ("total_params", "activated_params_per_token", "layers", "moe_layers", "experts",
                "top_k", "kv_bytes_per_token", "per_rank"):
        assert key in d
    assert d["kv_bytes_per_token"] == {"fp8": 35136, "bf16": 70272}
    pr = d["per_rank"]
    # 32 of 256 experts per GPU: about 100 GB of FP8 weights beside the KV cache
    assert 90e9 < pr["weight_bytes"] < 110e9
    assert pr["kv_capacity_tokens"] == pr["kv_capacity_tokens_by_dtype"]["fp8"]
    assert pr["kv_capacity_tokens_by_dtype"]["bf16"] == pr["kv_capacity_tokens"] // 2
    assert pr["kv_capacity_tokens"] == int(pr["kv_bytes"] // 35136)


def test_describe_table(capsys):
    code, out, _ = run(capsys, "describe", "--model", "deepseek-r1", "--dp", "8", "--ep", "8",
                       "--hardware", "mi300x")
    assert code == 0 and "weights / GPU" in out and "KV tokens / GPU" in out


@pytest.mark.parametrize("argv, message", [
    (["--model", "no-such-model"], "unknown model"),
    (["--model", "mixtral-8x7b", "--nodes", "2", "--dp", "16", "--ep", "16"],
     "ep 16 does not divide the 8 experts"),
    (["--model", "deepseek-r1", "--dp", "4", "--tp", "4"], "does not match the 8 GPUs"),
    (["--model", "deepseek-r1", "--dp", "-1"], "expected an integer in [1, 2**16], got '-1'"),
    (["--model", "deepseek-r1", "--hardware", "tpu9"], "unknown hardware"),
])
def test_bad_input_is_one_line_exit_2(capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        code = main(["describe", *argv])
        raise SystemExit(code)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_malformed_config_file(capsys, tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"model_type": "deepseek_v3", "hidden_size": 10}')
    code, _, err = run(capsys, "describe", "--model", str(path))
    assert code == 2 and "lacks required key" in err and err.count("\n") == 1


def test_python_dash_m_entry(epsim):
    r = epsim("describe", "--model", "tiny-deepseek", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["moe_layers"] == 2
    bad = epsim("describe", "--model", "nope")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "Traceback" not in bad.stderr


def test_describe_kimi_k2_config_file(epsim):
    """A config.json of another model_type on DeepSeek-V3's architecture (Kimi-K2)."""
    r = epsim("describe", "--model", "tests/data/kimi-k2-config.json", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["family"] == "deepseek_v3" and d["experts"] == 384 and d["moe_layers"] == 60
    assert d["total_params"] == 1_026_408_232_448  # about 1.03e12, Moonshot's "1T"
