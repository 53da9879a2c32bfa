"""``calibrate --from-trace``: the kernel-name table, the Kineto reader's launch links and
annotation scope, the per-kind mapping on a small hand-written trace, the deployment taken from
the trace's metadata, and a fit that reproduces the measured per-kind times."""

import json

import pytest

from epsim.calibrate import kineto
from epsim.calibrate import trace_calibrate as tc
from epsim.calibrate.kernel_names import FAMILIES, classify
from epsim.cli import main
from epsim.model.opgraph import OP_KINDS
from epsim.sim.hardware.profile import load_profile, profile_from_dict

# names as DeepSeek's published H800 profile records them (typed here, not read from a file)
REAL = {
    "void dpsk::ep::internode::combine<false, 8, __nv_bfloat16, 8, 2, 16, 24>(int)": "combine",
    "void dpsk::ep::internode::cached_notify<false>(int, int)": "combine",
    "void dpsk::ep::internode::notify_dispatch<false, 8>(int const*)": "dispatch",
    "void dpsk::ep::internode::dispatch<false, 8, true, 8>(void*)": "dispatch",
    "void dpsk::ep::cuda::get_dispatch_layout<256, 32, 8>(long const*)": "dispatch",
    "void cutlass::device_kernel<dpsk::grouped_gemm::cuda::m_grouped_fp8_ptp128c::GemmKernel>"
    "(dpsk::grouped_gemm::cuda::m_grouped_fp8_ptp128c::GemmKernel::Params)": "grouped_gemm",
    "void cutlass::device_kernel<dpsk::grouped_gemm::cuda::fp8_ptp128c::GemmKernel>(P)": "gemm",
    "void flash::compute_attn_ws<Flash_fwd_kernel_traits<192, 128, 128, 12, 2, false, 1, "
    "cutlass::bfloat16_t, 128>, true>(P)": "attention_prefill",
    "void cutlass::device_kernel<flash::FlashAttnBwd<flash::CollectiveMainloopBwd<2> > >(P)":
        "attention_prefill",
    "void layer_norm::ln_fwd_kernel<layer_norm::Kernel_traits<__nv_bfloat16, 7168u> >(P)":
        "norm",
    "rotary_kernel": "rope",
    "void at::native::sbtopk::gatherTopK<float, unsigned int, 2, false>(P)": "router",
    "void cuda::per_token_cast_to_fp8_with_channels<__nv_bfloat16, 128>(P)": "elementwise",
    "_ZN5aiter47fmoe_bf16_blockscaleFp8_g1u1_vs_silu_1tg_32x128E": "grouped_gemm",
    "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)": "all_reduce",
    "void mori::moe::EpCombineIntraNodeKernel<__hip_bfloat16>(args)": "combine",
    "fused_moe_kernel": "grouped_gemm",
    "Cijk_Ailk_Bljk_BBS_BH_Bias_HA_S_SAV_UserArgs_MT128x128x64_MI16x16x1": "gemm",
}


@pytest.mark.parametrize("name,kind", sorted(REAL.items()))
def test_real_kernel_names_map_to_their_op_kind(name, kind):
    assert classify(name).kind == kind


@pytest.mark.parametrize("name", ["ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)",
                                  "ncclDevKernel_Generic(args)", "_copy_tensor_kernel",
                                  "my_custom_kernel", "void cutlass::device_kernel<Foo>(P)"])
def test_no_catch_all_names_a_kernel_no_family_knows(name):
    assert classify(name) is None


def test_every_family_is_named_once_has_a_source_and_matches_its_own_example_first():
    assert len({f.name for f in FAMILIES}) == len(FAMILIES)
    for f in FAMILIES:
        assert f.kind in OP_KINDS and f.source
        assert classify(f.example) is f, f.name


def _trace(world=2, seqlen=256, device="NVIDIA H800"):
    """Two forward annotations and a backward one on thread (1, 1); six kernels launched by
    runtime calls (1-4), a flow start only (5) and a CPU op's External id only (6)."""
    ann = [("attn(F)", 0, 100), ("mlp(F)", 100, 100), ("attn(B)", 200, 100)]
    launches = {1: 10, 2: 50, 3: 150, 4: 250}
    kernels = [(1, "void flash::compute_attn_ws<T>(P)", 40),
               (2, "_copy_tensor_kernel", 10),
               (3, "void cutlass::device_kernel<dpsk::grouped_gemm::cuda::m_grouped_fp8_ptp128c"
                   "::GemmKernel>(P)", 100),
               (4, "void cutlass::device_kernel<flash::FlashAttnBwd<M> >(P)", 500),
               (5, "void deep_ep::internode::dispatch<false, 8, false, 8>(P)", 30),
               (6, "void layer_norm::ln_fwd_kernel<T>(P)", 20)]
    ev = [{"ph": "X", "cat": "user_annotation", "name": n, "pid": 1, "tid": 1, "ts": t,
           "dur": d, "args": {}} for n, t, d in ann]
    ev += [{"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1,
            "ts": t, "dur": 2, "args": {"correlation": c, "External id": c}}
           for c, t in launches.items()]
    ev.append({"ph": "s", "cat": "ac2g", "name": "ac2g", "id": 5, "pid": 1, "tid": 1, "ts": 60})
    ev.append({"ph": "X", "cat": "cpu_op", "name": "aten::layer_norm", "pid": 1, "tid": 1,
               "ts": 120, "dur": 5, "args": {"External id": 99}})
    for c, name, dur in kernels:
        args = {"correlation": c, "stream": 7} if c != 6 else {"External id": 99}
        ev.append({"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": 7,
                   "ts": 1000 + c, "dur": dur, "args": args})
    ev.append({"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD", "pid": 0, "tid": 7,
               "ts": 1100, "dur": 3, "args": {"correlation": 1}})
    return {"schemaVersion": 1, "deviceProperties": [{"id": 0, "name": device}],
            "distributedInfo": {"backend": "nccl", "rank": 0, "world_size": world},
            "traceName": f"prof_ep{world}_seqlen{seqlen}.json", "traceEvents": ev}


def test_forward_scope_maps_the_kernels_launched_under_its_annotations():
    trace = kineto.parse_trace(_trace())
    spans = kineto.scope_annotations(trace, None)
    m = tc.map_trace(trace, spans)
    # 40 + 10 + 100 + 30 (via the flow) + 20 (via External id); the backward 500 is out
    assert (m.kernels, m.kernel_us, m.mapped_us) == (5, 200.0, 190.0)
    assert m.mapped_fraction == pytest.approx(0.95)
    assert m.kind_us() == {"grouped_gemm": 100.0, "attention_prefill": 40.0, "dispatch": 30.0,
                           "norm": 20.0}
    assert m.unmapped == [{"name": "_copy_tensor_kernel", "us": 10.0, "count": 1}]
    assert m.copy_us == 3.0
    assert m.annotations["mlp(F)"] == {"count": 2, "kernel_us": 120.0, "mapped_us": 120.0}
    assert tc.layers_in(spans) == 1
    whole = tc.map_trace(trace, kineto.scope_annotations(trace, ()))
    assert (whole.kernel_us, whole.mapped_us) == (700.0, 690.0)


def test_metadata_names_world_size_device_and_sequence_length():
    meta = kineto.parse_trace(_trace(world=16, seqlen=1024)).metadata
    assert (meta["world_size"], meta["rank"], meta["seq_len"]) == (16, 0, 1024)
    assert meta["device"] == "NVIDIA H800"


def _write(tmp_path, obj, name="t.json"):
    path = tmp_path / name
    path.write_text(json.dumps(obj))
    return str(path)


def _run(capsys, *argv):
    status = main(["calibrate", *argv])
    out = capsys.readouterr()
    return status, out.out, out.err


def test_cli_json_reports_mapped_fraction_and_the_unmapped_names(tmp_path, capsys):
    status, out, _ = _run(capsys, "--from-trace", _write(tmp_path, _trace()), "--json")
    obj = json.loads(out)
    assert status == 0 and obj["mapped_fraction"] == pytest.approx(0.95)
    assert obj["unmapped"][0]["name"] == "_copy_tensor_kernel"
    assert "comparison" not in obj  # no --model: the mapping alone


def test_cli_compares_the_deployment_the_trace_describes(tmp_path, capsys):
    status, out, _ = _run(capsys, "--from-trace", _write(tmp_path, _trace()), "--model",
                          "tiny-deepseek", "--json")
    obj = json.loads(out)
    dep = obj["deployment"]
    assert status == 0
    assert (dep["hardware"], dep["dp"], dep["ep"], dep["context"], dep["layers"]) == \
        ("h800", 2, 2, 256, 1)
    assert obj["comparison"]["grouped_gemm"]["measured_us"] == 100.0
    assert obj["comparison"]["grouped_gemm"]["simulated_us"] > 0


#: a kernel of _trace() by a piece of its name -> the op kind it maps to
_KERNEL_KINDS = {"compute_attn_ws": "attention_prefill", "m_grouped_fp8": "grouped_gemm",
                 "ln_fwd_kernel": "norm"}


def _trace_at(capsys, tmp_path, factors):
    """_trace() with each mapped compute kernel's time set to what the roofline (which the fit
    scales) gives its kind under ``op_time_scale = factors``, in the deployment the CLI reads
    from the trace: a trace whose true factors are ``factors``."""
    dep = tc.TracedStep(model="tiny-deepseek", hardware="h800", kernels=None, nodes=1,
                        gpus_per_node=2, dp=2, ep=2, tp=1, batch=1, context=256, layers=1,
                        rank=0)
    truth = tc.fit_profile(load_profile("h800").raw, factors, "test: known factors")
    simulated = tc.simulate_kinds(dep, kernels="none", profile=profile_from_dict(truth))
    obj = _trace()
    for ev in obj["traceEvents"]:
        kind = next((k for piece, k in _KERNEL_KINDS.items() if piece in ev["name"]), None)
        if ev.get("cat") == "kernel" and kind is not None:
            ev["dur"] = simulated[kind]
    return _write(tmp_path, obj, "scaled.json")


def test_cli_fit_reproduces_the_measured_times_and_says_where_they_came_from(tmp_path, capsys):
    out_path = tmp_path / "fit.json"
    trace = _trace_at(capsys, tmp_path, {"attention_prefill": 1.5, "grouped_gemm": 0.8,
                                         "norm": 2.0})
    status, out, err = _run(capsys, "--from-trace", trace, "--model", "tiny-deepseek", "--out",
                            str(out_path), "--json")
    obj = json.loads(out)
    assert status == 0 and set(obj["fitted"]) >= {"grouped_gemm", "attention_prefill", "norm"}
    assert obj["refused"] == [] and "warning" not in err
    for kind in ("grouped_gemm", "attention_prefill", "norm"):
        row = obj["refit_comparison"][kind]
        assert row["simulated_us"] == pytest.approx(row["measured_us"], rel=1e-3)
    profile = load_profile(str(out_path))
    assert "calibrate --from-trace" in profile.sources["efficiency.op_time_scale"]
    assert profile.require_efficiency().scale("grouped_gemm") == obj["fitted"]["grouped_gemm"]


def test_an_implausible_trace_fit_is_refused_and_the_sourced_value_kept(tmp_path, capsys):
    # true factors grouped_gemm 40 and norm 60: refused; attention 1.5: fitted (a norm of the
    # tiny model needs a large factor to rise above the kernel floor, which the fit cannot scale)
    trace = _trace_at(capsys, tmp_path, {"attention_prefill": 1.5, "grouped_gemm": 40.0,
                                         "norm": 60.0})
    out_path = tmp_path / "fit.json"
    status, out, err = _run(capsys, "--from-trace", trace, "--model", "tiny-deepseek", "--out",
                            str(out_path), "--json")
    obj = json.loads(out)
    assert status == 0
    refused = {r["factor"]: r for r in obj["refused"]}
    assert set(refused) == {"grouped_gemm", "norm"}
    # the fit stops following a kind once its estimate leaves the range (on its way to 40)
    assert refused["grouped_gemm"]["fitted"] > 4.0
    assert refused["norm"]["range"] == [0.25, 4.0] and refused["norm"]["kept"] == 1.0
    assert err.count("warning: calibrate --from-trace: fitted") == 2
    assert set(obj["fitted"]) == {"attention_prefill"}
    scale = load_profile(str(out_path)).require_efficiency()
    assert (scale.scale("grouped_gemm"), scale.scale("norm")) == (1.0, 1.0)
    row = obj["refit_comparison"]["attention_prefill"]
    assert row["simulated_us"] == pytest.approx(row["measured_us"], rel=1e-3)
    # the text report says so too
    status, text, _ = _run(capsys, "--from-trace", trace, "--model", "tiny-deepseek", "--out",
                           str(out_path))
    assert status == 0 and "refused" in text and "grouped_gemm" in text


@pytest.mark.parametrize("argv,needle", [
    (["--annotations", "nope(F)"], "no annotation named nope(F)"),
    (["--out", "PLACEHOLDER"], "give --model"),
    (["--model", "tiny-deepseek", "--annotations", "all", "--out", "PLACEHOLDER"],
     "fits a forward step"),
    (["--model", "tiny-deepseek", "--hardware", "h800"], None),
])
def test_cli_errors_are_one_line(tmp_path, capsys, argv, needle):
    argv = [str(tmp_path / "o.json") if a == "PLACEHOLDER" else a for a in argv]
    trace = _trace(device="Some GPU") if needle is None else _trace()
    status, _, err = _run(capsys, "--from-trace", _write(tmp_path, trace), *argv)
    if needle is None:  # an unknown device, but --hardware given: fine
        assert status == 0
        return
    assert status == 2 and needle in err and err.count("\n") == 1


def test_a_file_that_is_not_a_trace_is_refused(tmp_path, capsys):
    for text in ("{not json", json.dumps({"traceEvents": []}), json.dumps({"x": 1})):
        path = tmp_path / "bad.json"
        path.write_text(text)
        status, _, err = _run(capsys, "--from-trace", str(path))
        assert status == 2 and err.count("\n") == 1


def test_calibrate_without_out_or_trace_is_refused(capsys):
    status, _, err = _run(capsys)
    assert status == 2 and "--out" in err


def test_the_documented_table_names_every_family():
    from conftest import REPO

    text = (REPO / "docs" / "validation.md").read_text()
    assert all(f"| `{f.name}` | {f.kind} |" in text for f in FAMILIES)
