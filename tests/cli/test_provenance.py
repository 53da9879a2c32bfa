"""Provenance (docs/provenance.md): every ``--json``, CSV row, ``--save-result`` file and chart
footer says which epsim, which hardware profile (name and SHA-256 of its file), which kernel set
and which published tables made it; ``epsim --version`` prints every shipped profile's hash."""

import csv
import hashlib
import json

import pytest
from conftest import REPO

import epsim as package
from epsim.frontier_chart import chart_footer
from epsim.provenance import footer_text, provenance, stamp_provenance
from epsim.sim.hardware.profile import load_profile, profile_from_dict, shipped_profiles

PROFILES = REPO / "src" / "epsim" / "sim" / "hardware" / "profiles"
TINY = ["--model", "tiny-deepseek", "--hardware", "mi300x", "--gpus-per-node", "2", "--dp", "2",
        "--ep", "2"]
WORK = ["--isl", "48", "--osl", "6"]
SLO = ["--slo", "median_itl_ms<=1000", "--dbo", "on"]


def _digest(name: str) -> str:
    """The profile file's SHA-256, as ``sha256sum`` prints it."""
    return hashlib.sha256((PROFILES / f"{name}.json").read_bytes()).hexdigest()


def _cited(name: str, kernel_set: str) -> dict[str, str]:
    """The table sources of ``kernel_set`` read straight from the profile file: every point's
    source id, the set's speedups' and those of the set it scales."""
    kernels = json.loads((PROFILES / f"{name}.json").read_text())["kernels"]
    ids: set[str] = set()
    while kernel_set and kernel_set != "none":
        s = kernels["sets"][kernel_set]
        for t in s.get("tables", []):
            # a point names its own source, else the table's
            ids.update(p[-1] if isinstance(p[-1], str) else t["source"] for p in t["points"])
        ids.update(f["source"] for f in s.get("speedup", {}).values())
        kernel_set = s.get("relative_to")
    out = {}
    for sid in ids:
        src = kernels["sources"][sid]
        out[sid] = (f"{src['repository']}@{src['commit']}" if "commit" in src
                    else src.get("url"))
    return out


def _version(run) -> str:
    r = run("--version")
    assert r.returncode == 0, r.stderr
    first = r.stdout.splitlines()[0]
    assert first.startswith("epsim ")
    return first.split()[1]


def _json(r):
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def _is(prov, version, name="mi300x", kernel_set="aiter"):
    assert prov["epsim_version"] == version
    assert prov["hardware_profile"] == name
    assert prov["profile_hash"] == _digest(name)
    assert prov["kernel_set"] == kernel_set
    assert prov["table_sources"] == _cited(name, kernel_set)


def test_version_prints_the_version_and_every_shipped_profiles_hash(epsim):
    r = epsim("--version")
    assert r.returncode == 0 and r.stderr == ""
    lines = r.stdout.splitlines()
    assert lines[0] == f"epsim {package.__version__}"
    listed = dict(line.split() for line in lines[2:])
    assert listed == {name: _digest(name) for name in shipped_profiles()}
    assert len(listed) == len(shipped_profiles()) > 0


def test_step_describe_and_balance_json(epsim):
    version = _version(epsim)
    out = _json(epsim("step", "--model", "deepseek-r1", "--hardware", "mi300x", "--batch", "8",
                      "--context", "1000", "--json"))
    assert next(iter(out)) == "provenance"  # first, where `head` shows it
    _is(out["provenance"], version)
    out = _json(epsim("step", "--model", "deepseek-r1", "--hardware", "h200", "--batch", "8",
                      "--context", "1000", "--kernels", "none", "--json"))
    _is(out["provenance"], version, "h200", "none")
    assert out["provenance"]["table_sources"] == {}
    out = _json(epsim("describe", "--model", "deepseek-r1", "--hardware", "h200", "--json"))
    _is(out["provenance"], version, "h200", "sglang")
    # made with no profile: the version, and no profile claimed
    for argv in (["describe", "--model", "deepseek-r1", "--json"],
                 ["balance", "--loads", "decode_in2000out100", "--gpus", "8", "--json"]):
        prov = _json(epsim(*argv))["provenance"]
        assert prov == {"epsim_version": version, "hardware_profile": None,
                        "profile_hash": None, "kernel_set": None, "table_sources": {}}


def test_predict_json_save_result_and_validate(epsim, tmp_path):
    version = _version(epsim)
    saved = tmp_path / "result.json"
    out = _json(epsim("predict", *TINY, *WORK, "--num-prompts", "8", "--request-rate", "2000",
                      "--save-result", str(saved), "--json"))
    _is(out["provenance"], version)
    epsim_keys = json.loads(saved.read_text())["epsim"]
    assert next(iter(epsim_keys)) == "provenance"
    _is(epsim_keys["provenance"], version)
    report = _json(epsim("validate", "--bench", str(saved), *TINY, "--json"))
    _is(report["provenance"], version)


def test_sweep_over_two_profiles_json_csv_and_frontier_csv(epsim, tmp_path):
    version = _version(epsim)
    rows_csv, front_csv = tmp_path / "s.csv", tmp_path / "f.csv"
    out = _json(epsim("sweep", *TINY[:2], "--hardware", "mi300x,h200", *TINY[4:], *WORK,
                      "--concurrency", "2,4", "--csv", str(rows_csv), "--frontier-csv",
                      str(front_csv), "--json"))
    top = out["provenance"]
    # two profiles: each profile key a list in order, the table sources merged
    assert top["hardware_profile"] == ["mi300x", "h200"]
    assert top["profile_hash"] == [_digest("mi300x"), _digest("h200")]
    assert top["kernel_set"] == ["aiter", "sglang"]
    assert top["table_sources"] == {**_cited("mi300x", "aiter"), **_cited("h200", "sglang")}
    for row in out["results"]:
        _is(row["provenance"], version, row["hardware"], {"mi300x": "aiter"}.get(
            row["hardware"], "sglang"))
    for path, n in ((rows_csv, 4), (front_csv, 4)):
        with path.open() as f:
            table = list(csv.DictReader(f))
        assert len(table) == n
        for cells in table:
            name = cells["provenance.hardware_profile"]
            assert cells["provenance.epsim_version"] == version
            assert cells["provenance.profile_hash"] == _digest(name)
            assert cells["provenance.kernel_set"] == {"mi300x": "aiter", "h200": "sglang"}[name]
            if name == "mi300x":
                assert (cells["provenance.table_sources.aiter-gemm-mi300x"]
                        == "ROCm/aiter@e4048607a535ace3a2b51ded31b1c8c2d45c0879")


def test_tune_and_plan_json_and_frontier_csv(epsim, tmp_path):
    version = _version(epsim)
    front = tmp_path / "f.csv"
    tuned = _json(epsim("tune", *TINY, *WORK, "--concurrency", "2,4", *SLO, "--frontier-csv",
                        str(front), "--json"))
    _is(tuned["provenance"], version)
    _is(tuned["best"]["provenance"], version)
    with front.open() as f:
        cells = next(csv.DictReader(f))
    assert (cells["provenance.epsim_version"], cells["provenance.profile_hash"]) == (
        version, _digest("mi300x"))
    plan = _json(epsim("plan", *TINY, *WORK, "--concurrency", "4", *SLO,
                       "--target-output-throughput", "1000", "--json"))
    _is(plan["provenance"], version)
    _is(plan["plans"][0]["provenance"], version)


def test_the_hash_is_the_files_and_tells_two_profiles_apart(tmp_path):
    assert load_profile("mi300x").profile_hash == _digest("mi300x")
    hashes = {load_profile(name).profile_hash for name in shipped_profiles()}
    assert len(hashes) == len(shipped_profiles())
    # the same profile with one more byte: same name, another hash
    copy = tmp_path / "mi300x.json"
    copy.write_bytes((PROFILES / "mi300x.json").read_bytes() + b"\n")
    other = load_profile(copy)
    assert other.name == "mi300x"
    assert other.profile_hash == hashlib.sha256(copy.read_bytes()).hexdigest() != _digest(
        "mi300x")
    # a profile built from a dict (no file) digests its canonical JSON
    raw = load_profile("mi300x").raw
    canonical = json.dumps(raw, sort_keys=True, separators=(",", ":"))
    assert profile_from_dict(raw).profile_hash == hashlib.sha256(canonical.encode()).hexdigest()


def test_a_scaled_kernel_set_cites_its_base_and_its_factors():
    prov = load_profile("mi300x", kernels="no-aiter").provenance()
    assert prov["kernel_set"] == "no-aiter"
    assert prov["table_sources"] == _cited("mi300x", "no-aiter")
    assert set(_cited("mi300x", "aiter")) < set(prov["table_sources"])
    assert "aiter-readme" in prov["table_sources"]  # the speedup factors' source


PLANTED = {"epsim_version": "9.9", "hardware_profile": "x1", "profile_hash": "ab" * 32,
           "kernel_set": "lib", "table_sources": {"t-gemm": "org/repo@" + "c" * 40,
                                                  "t-blog": "https://example.org/post"}}


def test_footer_text_names_version_profile_hash_set_and_tables():
    assert footer_text(PLANTED) == (
        "epsim 9.9 | x1 sha256:abababababababab kernels lib\n"
        "tables: t-gemm org/repo@cccccccccccc, t-blog https://example.org/post")
    two = provenance({**PLANTED, "hardware_profile": "x1"},
                     {**PLANTED, "hardware_profile": "x2", "profile_hash": "cd" * 32,
                      "table_sources": {}})
    assert footer_text(two).splitlines()[0] == (
        f"epsim {package.__version__} | x1 sha256:abababababababab kernels lib | "
        "x2 sha256:cdcdcdcdcdcdcdcd kernels lib")
    # long lists wrap under the width, nothing lost
    many = {**PLANTED, "table_sources": {f"t{i}": f"org/r@{i:040d}" for i in range(20)}}
    lines = footer_text(many, width=80).splitlines()
    assert all(len(line) <= 80 for line in lines) and len(lines) > 3
    assert " ".join(lines).count("org/r@") == 20
    # the chart's footer: its points' provenance
    assert chart_footer([{"provenance": PLANTED}, {"provenance": PLANTED}]) == footer_text(
        provenance(PLANTED))
    assert chart_footer([]) == f"epsim {package.__version__}"


def test_stamp_completes_nested_results_once():
    row = {"figure": 1.0, "provenance": {k: PLANTED[k] for k in PLANTED if k != "epsim_version"}}
    out = stamp_provenance({"results": [row, row], "n": 2})
    assert list(out) == ["provenance", "results", "n"]
    assert row["provenance"]["epsim_version"] == package.__version__
    assert list(row) == ["figure", "provenance"]  # after the figures
    assert out["provenance"]["hardware_profile"] == "x1"
    again = stamp_provenance(json.loads(json.dumps(out)))
    assert again == out  # stamping twice changes nothing


@pytest.mark.parametrize("name", ["mi300x", "h200"])
def test_every_shipped_default_set_cites_only_known_sources(name):
    prov = load_profile(name).provenance()
    assert prov["table_sources"] == _cited(name, prov["kernel_set"])
    assert all("@" in v or v.startswith("https://") for v in prov["table_sources"].values())
