"""Engine presets: each default equals the value read from the engine's code (vLLM 0.33.0,
SGLang 0.5.23), explicit flags override them, and the reference scenario runs under each."""

import json
import re
from pathlib import Path

import numpy as np
import pytest
from serving_models import Affine, affine_factory

from epsim.model.errors import EpsimError
from epsim.sim.scenario import StepCache, run_scenario
from epsim.sim.serving import ServingConfig, simulate_serving
from epsim.sim.serving.presets import (
    ENGINES,
    EPSIM_CHUNKED_PREFILL,
    HOST_MS_PER_STEP,
    MAX_FITTED,
    EngineContext,
    EngineOverrides,
    EnginePreset,
    charges_host,
    default_engine,
    engine_preset,
    engine_settings,
    sglang_max_running,
    vllm_batch_defaults,
)
from epsim.sim.serving.step_time import EngineStepTime, StepCost, StepPolicy
from epsim.sim.spec import Scenario
from epsim.sim.workload.spec import Requests, WorkloadSpec

GB = 1e9
#: DeepSeek-R1 on 8x MI300X, DP8/EP8, FP8 KV: one rank's KV tokens and the model's context
R1_MI300X = EngineContext(hbm_bytes=192 * GB, dp=8, tp=1, kv_capacity_tokens=1_925_783,
                          context_len=163_840)


def on(hbm_gb, dp=8, tp=1):
    return EngineContext(hbm_bytes=hbm_gb * GB, dp=dp, tp=tp, kv_capacity_tokens=1_000_000,
                         context_len=163_840)


def test_vllm_defaults_by_device_memory():
    # EngineArgs.get_batch_defaults, OPENAI_API_SERVER: >= 160 GiB, >= 70 GiB, smaller
    assert vllm_batch_defaults(192 * GB) == (16384, 1024)  # MI300X (178.8 GiB)
    assert vllm_batch_defaults(141 * GB) == (8192, 1024)  # H200
    assert vllm_batch_defaults(80 * GB) == (8192, 1024)  # H100 (74.5 GiB)
    assert vllm_batch_defaults(48 * GB) == (2048, 256)
    s = engine_settings("vllm", R1_MI300X)
    assert (s.scheduler, s.max_batched_tokens, s.max_running_per_rank) == ("decode_first", 16384,
                                                                          1024)
    # capture sizes up to min(max_num_seqs * 2, 512); DBO off, thresholds 32 / 512
    assert s.cuda_graph_max_bs == 512
    assert (s.dbo, s.dbo_min_decode_tokens, s.dbo_min_prefill_tokens) == (False, 32, 512)
    # host: 0.62 ms / 32 requests per request, 0.1 ms of DP sync at dp 8, overlapped
    assert (s.host_ms_per_step, s.host_us_per_request, s.host_dp_sync_ms) == (0.0, 19.375, 0.1)
    assert s.host_overlap and engine_settings("sglang", R1_MI300X).host_ms_per_step == 4.0
    assert HOST_MS_PER_STEP == 4.0
    assert engine_settings("vllm", on(48)).cuda_graph_max_bs == 512  # min(256 * 2, 512)


def test_sglang_defaults_by_device_memory_and_dp_attention():
    s = engine_settings("sglang", R1_MI300X)
    # MI300X is above 160 GiB: chunk 16384 over 8 DP-attention ranks, decode graphs to 512
    assert (s.scheduler, s.chunked_prefill_size, s.cuda_graph_max_bs) == ("sglang", 2048, 512)
    # resolve_max_num_reqs: 1.9M tokens / 163840 * 512 = 6018, clamped to [2048, 4096]
    assert s.max_running_per_rank == 4096
    assert sglang_max_running(100_000, 163_840) == 2048  # 312 clamped up to 2048
    assert sglang_max_running(3000, 163_840) == 1500  # at most half the tokens
    assert (s.dbo, s.max_batched_tokens, s.mixed_chunk) == (False, 16384, False)
    h100 = engine_settings("sglang", on(80, dp=8, tp=1))
    assert (h100.chunked_prefill_size, h100.cuda_graph_max_bs) == (1024, 256)  # 8192 / 8
    assert engine_settings("sglang", on(80, dp=1, tp=8)).cuda_graph_max_bs == 512  # tp >= 4
    assert engine_settings("sglang", on(80, dp=1, tp=8)).chunked_prefill_size == 8192


def test_split_is_vllm_with_the_reports_dbo_and_prefill_first_is_epsims_own():
    s = engine_settings("split", R1_MI300X)
    assert (s.scheduler, s.dbo, s.max_running_per_rank) == ("split", True, 1024)
    e = engine_settings("prefill_first", R1_MI300X)
    assert (e.scheduler, e.chunked_prefill_size, e.max_running_per_rank) == (
        "prefill_first", EPSIM_CHUNKED_PREFILL, None)
    assert (e.cuda_graph_max_bs, e.host_ms_per_step, e.dbo) == (None, 0.0, False)
    # only the reference report's split engine turns DBO on by default
    assert [engine_preset(n).dbo_default for n in ("vllm", "sglang", "split", "prefill_first")
            ] == [False, False, True, False]
    # --engine prefill_first keeps its own policy whatever caps are given
    e = engine_settings("prefill_first", R1_MI300X, EngineOverrides(max_num_seqs=100, dbo=True))
    assert (e.max_running_per_rank, e.dbo) == (None, True)
    with pytest.raises(EpsimError, match="unknown engine None"):
        engine_settings(None, R1_MI300X)


def test_the_registry_holds_the_four_presets_each_with_its_defaults():
    assert list(ENGINES) == ["vllm", "sglang", "split", "prefill_first"]
    assert all(isinstance(p, EnginePreset) and p.name == n for n, p in ENGINES.items())
    assert {n: p.dbo_default for n, p in ENGINES.items()} == {
        "vllm": False, "sglang": False, "split": True, "prefill_first": False}
    # each preset's settings carry its name and its DBO default
    for name, preset in ENGINES.items():
        s = preset.settings(R1_MI300X)
        assert (s.engine, s.dbo, s.prefill_eager) == (name, preset.dbo_default,
                                                      preset.prefill_eager)
        assert engine_settings(name, R1_MI300X) == s and engine_preset(name) is preset
    # only epsim's own policy has no host model, no caps to override, and runs prefill as the
    # plan says
    assert [n for n, p in ENGINES.items() if not p.has_host_model] == ["prefill_first"]
    assert [n for n, p in ENGINES.items() if not p.overridable] == ["prefill_first"]
    assert [n for n, p in ENGINES.items() if not p.prefill_eager] == ["prefill_first"]
    assert [charges_host(n) for n in (None, "vllm", "prefill_first")] == [True, True, False]
    # a home for fitted engine parameters, empty until a fit fills it
    assert all(dict(p.fitted) == {} and len(p.fitted) <= MAX_FITTED for p in ENGINES.values())


@pytest.mark.parametrize("name", ["tensorrt", None, "VLLM"])
def test_an_unknown_engine_is_refused_in_one_line_naming_the_four(name):
    with pytest.raises(EpsimError) as e:
        engine_preset(name)
    assert str(e.value) == (f"unknown engine {name!r} (one of vllm, sglang, split, "
                            "prefill_first)")


#: an engine's name compared as a string: ``== "vllm"``, ``"split" !=``, ``is "sglang"``,
#: ``in ("vllm", ...)``, ``== PREFILL_FIRST``
_NAME = r"""["'](?:vllm|sglang|split|prefill_first)["']"""
NAME_COMPARED = re.compile(
    rf"(?:==|!=|\bis(?:\s+not)?)\s*(?:{_NAME}|PREFILL_FIRST\b)|{_NAME}\s*(?:==|!=)"
    rf"|\bin\s*[(\[{{][^()\[\]{{}}]*{_NAME}")


def test_the_regex_finds_each_form_of_a_compared_engine_name():
    for line in ('if engine == "vllm":', "x = e != 'sglang'", 'if "split" == e:',
                 'e in ("vllm",\n      "sglang")', "e not in ['prefill_first']",
                 "sc.engine == PREFILL_FIRST", 'e is "split"'):
        assert NAME_COMPARED.search(line), line
    for line in ('ENGINES = {"vllm": VllmPreset()}', 'name = "sglang"', 'dims = [("split", 1)]',
                 'scheduler: str = "prefill_first"', 'for f in (Format("vllm"), Format("x"))'):
        assert not NAME_COMPARED.search(line), line


def test_no_engine_name_is_compared_as_a_string_outside_the_registry():
    src = Path(__file__).resolve().parents[3] / "src"
    found = []
    for path in sorted(src.rglob("*.py")):
        if path.relative_to(src).as_posix() == "epsim/sim/serving/presets.py":
            continue
        text = "\n".join(line for line in path.read_text().splitlines()
                         if not line.lstrip().startswith("#"))
        found += [f"{path.relative_to(src)}: {m.group(0)!r}" for m in NAME_COMPARED.finditer(text)]
    assert not found, "ask the preset (presets.engine_preset) instead: " + "; ".join(found)


def test_the_default_engine_is_the_hardware_vendors():
    assert default_engine("amd") == "vllm" and default_engine("nvidia") == "sglang"
    assert default_engine("cpu") == "vllm"


def test_explicit_flags_override_a_preset():
    s = engine_settings("vllm", R1_MI300X, EngineOverrides(max_num_seqs=100, dbo=True))
    # vLLM sizes its graphs from the cap: min(100 * 2, 512)
    assert (s.max_running_per_rank, s.cuda_graph_max_bs, s.dbo) == (100, 200, True)
    assert s.sources["max_running_per_rank"] == "flag"
    s = engine_settings("sglang", R1_MI300X, EngineOverrides(max_num_seqs=100))
    assert s.cuda_graph_max_bs == 100  # SGLang lowers its default graph size to the cap
    s = engine_settings("vllm", R1_MI300X, EngineOverrides(max_num_batched_tokens=4096,
                                                           cuda_graph_max_bs=64,
                                                           chunked_prefill_size=1024))
    assert (s.max_batched_tokens, s.cuda_graph_max_bs, s.chunked_prefill_size) == (4096, 64,
                                                                                   1024)
    with pytest.raises(EpsimError, match="must be at least --max-num-seqs"):
        engine_settings("vllm", R1_MI300X, EngineOverrides(max_num_batched_tokens=512))


def test_step_policy_runs_large_decode_batches_eagerly_and_hides_the_host_time():
    seen = []

    class Tagged(Affine):
        def __init__(self, tag):
            super().__init__(base=0.001 if tag == (True, False) else 0.002)
            self.tag = tag

        def decode(self, seqs, context):
            seen.append(self.tag)
            return super().decode(seqs, context)

    models = {(g, d): Tagged((g, d)) for g in (True, False) for d in (True, False)}
    costs = EngineStepTime(lambda g, d, *_: models[(g, d)],
                           StepPolicy(graph=True, dbo=True, graph_max_bs=512,
                                      dbo_min_decode_tokens=32, host_s=0.0015))
    costs.decode(512, 100)
    costs.decode(513, 100)
    costs.decode(32, 100)
    costs.decode(8, 100, any_prefill=False)
    assert seen == [(True, True), (False, True), (True, False), (True, False)]
    # overlapped host time: a 1 ms step lasts 1.5 ms, a 2 ms one 2 ms
    assert costs.wall(0.001) == pytest.approx(0.0015) and costs.wall(0.002) == 0.002


def test_a_mixed_batch_pays_the_chunk_with_its_decode_tokens_plus_their_attention():
    class Exact:
        def decode(self, seqs, context):
            return StepCost(1.0, {"attention": 1.0 * seqs * context})  # ms

        def prefill(self, seqs, prompt, prefix):
            return StepCost(1e-4 * seqs * (prompt - prefix), {"attention": 0.0})

    cost = EngineStepTime.of(Exact()).mixed(4, 1000, 0, 10, 50)
    # 4 x 1000 new tokens, the 10 decodes join them as 3 more each; their attention 0.5 s
    assert cost.seconds == pytest.approx(1e-4 * 4 * 1003 + 0.5)
    assert cost.breakdown_ms["attention"] == pytest.approx(500.0)


def test_preset_costs_reach_the_serving_loop():
    # a decode-first step of 3 decodes on one rank with 2 ms host time, overlapped
    req = Requests(np.array([10, 10, 10]), np.array([3, 3, 3]), np.zeros(3))
    costs = EngineStepTime.of(Affine(base=0.001, p_base=0.01), StepPolicy(host_s=0.002))
    run = simulate_serving(req, ServingConfig(dp=1, kv_capacity_tokens=10**6,
                                              scheduler="decode_first"), costs)
    assert [s.seconds for s in run.steps] == pytest.approx([0.01, 0.002, 0.002])


def test_reference_scenario_under_each_preset():
    # DeepSeek-R1, DP8/EP8 on 8x MI300X, 4096 requests of 2000 in / 100 out, one wave; the
    # real memory accounting and presets, analytic step times (a prefill token 0.1 ms, about
    # the simulator's figure for DeepSeek-R1 on MI300X)
    cache = StepCache(affine_factory(p_token=1e-4))
    w = WorkloadSpec(num_prompts=4096, isl=2000, osl=100, concurrency=4096)

    def run(**kw):
        return run_scenario(Scenario.of(model="deepseek-r1", hardware="mi300x", dp=8, ep=8,
                                     workload=w, dbo=None, **kw), cache)

    vllm, sglang = run(engine="vllm"), run(engine="sglang")
    capped = run(engine="vllm", max_num_seqs=256)
    for r in (vllm, sglang, capped):
        assert r["completed"] == 4096 and r["preemptions"] == 0
    assert capped["max_running_per_rank"] <= 256 < vllm["max_running_per_rank"]
    # docs/serving.md: vLLM's 16384-token budget prefills the wave sooner than SGLang's 2048
    # tokens per rank (16384 over 8 DP ranks), so first tokens come earlier; but its decodes
    # ride in steps that carry those chunks, so its inter-token gaps are long while the wave
    # prefills, where SGLang's decode at the pure decode step once it has decoded at all
    assert vllm["p90_ttft_ms"] < sglang["p90_ttft_ms"]
    assert vllm["p90_itl_ms"] > 5 * sglang["p90_itl_ms"]
    assert (vllm["engine"], vllm["scheduler"], sglang["scheduler"]) == ("vllm", "decode_first",
                                                                        "sglang")


def test_predict_engine_flags_end_to_end(epsim):
    res = epsim("predict", "--model", "deepseek-r1", "--hardware", "mi300x", "--dp", "8", "--ep",
                "8", "--concurrency", "4096", "--num-prompts", "4096", "--isl", "2000", "--osl",
                "100", "--engine", "sglang", "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert (out["engine"], out["scheduler"], out["dbo"], out["chunked_prefill_size"]) == (
        "sglang", "sglang", False, 2048)
    res = epsim("predict", "--model", "deepseek-r1", "--hardware", "mi300x", "--isl", "256",
                "--osl", "8", "--concurrency", "64", "--engine", "vllm", "--dbo",
                "--max-num-seqs", "4", "--max-num-batched-tokens", "512", "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["dbo"] is True and out["max_running_per_rank"] <= 4
    assert (out["max_num_seqs"], out["max_num_batched_tokens"]) == (4, 512)
    res = epsim("predict", "--model", "deepseek-r1", "--hardware", "mi300x", "--isl", "256",
                "--osl", "8", "--dbo", "--no-dbo")
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "contradict" in res.stderr


def test_dbo_needs_ep_an_engines_default_does_not_apply_and_an_explicit_one_is_refused(epsim):
    tp8 = ["predict", "--model", "deepseek-r1", "--hardware", "mi300x", "--tp", "8",
           "--concurrency", "4", "--isl", "100", "--osl", "10"]
    # split runs DBO by default, but not on a TP-only plan: one microbatch, said so
    r = epsim(*tp8, "--engine", "split", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["dbo"] is False
    refused = epsim(*tp8, "--dbo")
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1
    assert "--dbo needs an expert-parallel plan" in refused.stderr
    ep8 = [*tp8[:5], "--dp", "8", "--ep", "8", *tp8[7:]]
    assert json.loads(epsim(*ep8, "--engine", "split", "--json").stdout)["dbo"] is True
