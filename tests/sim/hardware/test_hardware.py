import json

import pytest

from epsim.model import EpsimError
from epsim.sim.hardware.profile import load_profile, shipped_profiles


def test_shipped_profiles_carry_design_figures():
    assert set(shipped_profiles()) >= {"mi300x", "mi325x", "mi355x", "h100", "h200"}
    mi = load_profile("mi300x")
    assert mi.peak("bf16") == 1307.4e12 and mi.peak("fp8") == 2614.9e12
    assert mi.hbm_bytes == 192e9 and mi.hbm_bandwidth == 5.3e12
    assert mi.fabric.topology == "full_mesh" and mi.fabric.links_per_gpu == 7
    assert mi.fabric.link_bandwidth == 64e9
    assert load_profile("mi325x").hbm_bytes == 256e9
    assert load_profile("mi355x").hbm_bandwidth == 8e12
    assert load_profile("h100").peak("fp8") == 1979e12
    assert load_profile("h200").hbm_bytes == 141e9


def test_every_number_has_a_source():
    for name in shipped_profiles():
        p = load_profile(name)
        for key in ("peak_flops", "hbm_bytes", "hbm_bandwidth", "fabric", "kernel_launch_s"):
            assert p.sources[key]


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.pop("hbm_bytes"), "lacks required key 'hbm_bytes'"),
    (lambda d: d.update(hbm_bandwidth=-1), "hbm_bandwidth must be a positive number"),
    (lambda d: d["fabric"].update(topology="torus"), "fabric.topology"),
    (lambda d: d["sources"].pop("fabric"), "sources lacks an entry for fabric"),
    (lambda d: d["peak_flops"].pop("fp8"), "peak_flops"),
])
def test_bad_profiles(tmp_path, mutate, message):
    data = json.loads(json.dumps(load_profile("mi300x").raw))
    mutate(data)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    with pytest.raises(EpsimError, match=message):
        load_profile(str(path))


def test_corrupt_and_unknown_profiles(tmp_path):
    path = tmp_path / "p.json"
    path.write_text("{")
    with pytest.raises(EpsimError, match="malformed profile JSON"):
        load_profile(str(path))
    with pytest.raises(EpsimError, match="unknown hardware 'b200'"):
        load_profile("b200")


def test_comm_concurrency_must_be_a_positive_integer(tmp_path):
    data = json.loads(json.dumps(load_profile("mi300x").raw))
    data["efficiency"]["comm_concurrency"] = 0
    data["sources"]["efficiency.comm_concurrency"] = "test"
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    with pytest.raises(EpsimError, match="comm_concurrency must be a positive integer"):
        load_profile(str(path))
    data["efficiency"]["comm_concurrency"] = 2
    path.write_text(json.dumps(data))
    assert load_profile(str(path)).efficiency.comm_concurrency == 2
    assert load_profile("mi300x").efficiency.comm_concurrency == 1
