"""Hardware profiles (costmodel.profiles): the shipped files, their published numbers, and
the errors a malformed profile file gets. No JAX needed."""
import dataclasses
import json

import pytest

from meshslice.costmodel import autotune
from meshslice.costmodel.profiles import (CollectiveParams, known_profiles, load_profile,
                                          save_profile)

from test_costmodel import _pair


def test_shipped_profiles_load_and_round_trip(tmp_path):
  assert set(known_profiles()) == {"tpu-v4", "tpu-v5e", "tpu-v5p", "tpu-v6e", "tpu-v7x",
                                  "h100", "cpu"}
  for name in known_profiles():
    p = load_profile(name)
    assert p.name == name
    save_profile(p, tmp_path / f"{name}.json")
    assert load_profile(tmp_path / f"{name}.json") == p
    assert load_profile(str(tmp_path / f"{name}.json")) == p
    assert "units" in json.loads((tmp_path / f"{name}.json").read_text())


def test_tpu_v4_is_the_published_calibration():
  p = load_profile("tpu-v4")
  # public numbers: 275 TFLOP/s bf16, 1.2e12 B/s and 32 GiB of HBM
  assert (p.peak_flops, p.hbm_bandwidth, p.hbm_capacity) == (2.75e14, 1.2e12, 32 * 2**30)
  # the original's assumptions are available on top of it
  paper = autotune.paper_assumptions(p)
  assert (paper.peak_flops, paper.gemm.max_efficiency, paper.hbm_bandwidth) == (2.66e14, 1.0, 0)
  assert paper.all_gather == p.all_gather
  assert p.all_gather == CollectiveParams(bandwidth=(27.472e9, 79.751e9),
                                          hop_latency=_pair(5e-6), base_overhead=_pair(13e-6))
  assert p.reduce_scatter == CollectiveParams(bandwidth=(37.506e9, 63.167e9),
                                              hop_latency=_pair(5e-6),
                                              base_overhead=_pair(26e-6))
  assert p.permute == CollectiveParams(bandwidth=(38.801e9, 35.224e9),
                                       hop_latency=_pair(5e-5), base_overhead=_pair(13e-6))


def test_unknown_profile_name_lists_known_ones():
  with pytest.raises(ValueError) as e:
    load_profile("tpu-v9")
  assert str(e.value) == ("unknown hardware profile 'tpu-v9'; known profiles: cpu, h100, "
                          "tpu-v4, tpu-v5e, tpu-v5p, tpu-v6e, tpu-v7x (or pass the path of a "
                          "profile JSON file)")


def _broken(tmp_path, edit):
  data = load_profile("tpu-v4").to_json_dict()
  edit(data)
  path = tmp_path / "broken.json"
  path.write_text(json.dumps(data))
  return path


@pytest.mark.parametrize("edit,message", [
    (lambda d: d["collectives"].pop("permute"), "missing field 'collectives.permute'"),
    (lambda d: d["gemm_efficiency"].pop("k_sat"), "missing field 'gemm_efficiency.k_sat'"),
    (lambda d: d.update(peak_flops="fast"), "field 'peak_flops' must be a number, got 'fast'"),
    (lambda d: d["collectives"]["all_gather"].update(hop_latency=[5e-6, -1.0]),
     "field 'collectives.all_gather.hop_latency[1]' must be >= 0 (no negative values), "
     "got -1.0"),
    (lambda d: d["collectives"]["reduce_scatter"].update(bandwidth=[1e9]),
     "field 'collectives.reduce_scatter.bandwidth' must be a pair [mesh dim 0, mesh dim 1], "
     "got [1000000000.0]"),
    (lambda d: d["collectives"]["permute"].update(bandwidth=[0, 1e9]),
     "field 'collectives.permute.bandwidth[0]' must be > 0, got 0"),
    (lambda d: d["gemm_efficiency"].update(max_efficiency=1.5),
     "field 'gemm_efficiency.max_efficiency' must be <= 1.0, got 1.5"),
    (lambda d: d.update(name=True), "field 'name' must be a non-empty string, got True"),
])
def test_malformed_profile_names_file_and_field(tmp_path, edit, message):
  path = _broken(tmp_path, edit)
  with pytest.raises(ValueError) as e:
    load_profile(path)
  assert str(e.value) == f"hardware profile {str(path)!r}: {message}"


def test_profile_file_that_is_not_json_or_missing(tmp_path):
  path = tmp_path / "bad.json"
  path.write_text("{ not json")
  with pytest.raises(ValueError, match=r"hardware profile '.*bad.json': not valid JSON"):
    load_profile(path)
  with pytest.raises(ValueError, match=r"hardware profile '.*nope.json': cannot read it"):
    load_profile(tmp_path / "nope.json")


def test_profiles_have_public_numbers_and_sources():
  gib = 2**30
  expect = {"tpu-v4": (2.75e14, 1.2e12, 32 * gib), "tpu-v5e": (1.97e14, 8.19e11, 16 * gib),
            "tpu-v5p": (4.59e14, 2.765e12, 95 * gib), "tpu-v6e": (9.18e14, 1.64e12, 32 * gib),
            "h100": (9.89e14, 3.35e12, 80e9)}
  for name, (peak, hbm, capacity) in expect.items():
    p = load_profile(name)
    assert (p.peak_flops, p.hbm_bandwidth, p.hbm_capacity) == (peak, hbm, capacity), name
    assert p.sources and all(isinstance(s, str) and s for s in p.sources), name
    assert p.op_overhead > 0
  # derived TPU profiles: link bandwidth (5e10 v5e, 1e11 v5p / v6e) times the efficiencies
  # the v4 calibration shows on its dim 1 (2 x 0.886 all-gather, 2 x 0.702 reduce-scatter,
  # 0.783 send/recv), and the v4 latencies / overheads
  v4 = load_profile("tpu-v4")
  for name, link in (("tpu-v5e", 5e10), ("tpu-v5p", 1e11), ("tpu-v6e", 1e11)):
    p = load_profile(name)
    assert p.all_gather.bandwidth == _pair(round(2 * link * 0.886, -6))
    assert p.reduce_scatter.bandwidth == _pair(round(2 * link * 0.702, -6))
    assert p.permute.bandwidth == _pair(round(link * 0.783, -6))
    for kind in ("all_gather", "reduce_scatter", "permute"):
      assert p.collective(kind).hop_latency == _pair(v4.collective(kind).hop_latency[1])
      assert p.collective(kind).base_overhead == v4.collective(kind).base_overhead
  assert v4.all_gather.bandwidth[1] == pytest.approx(2 * 4.5e10 * 0.886, rel=1e-3)


def test_profile_optional_fields_validate_and_default(tmp_path):
  data = load_profile("tpu-v4").to_json_dict()
  for key in ("hbm_bandwidth", "hbm_capacity", "op_overhead", "sources"):
    data.pop(key)
  path = tmp_path / "old.json"
  path.write_text(json.dumps(data))
  old = load_profile(path)
  assert (old.hbm_bandwidth, old.hbm_capacity, old.op_overhead, old.sources) == (0, 0, 0, ())
  data["sources"] = "a string"
  path.write_text(json.dumps(data))
  with pytest.raises(ValueError, match="field 'sources' must be a list of strings"):
    load_profile(path)
  data["sources"], data["hbm_bandwidth"] = ["x, y,z"], -1
  path.write_text(json.dumps(data))
  with pytest.raises(ValueError, match="field 'hbm_bandwidth' must be >= 0"):
    load_profile(path)
  # sources with commas survive a save / load round trip unchanged
  p = dataclasses.replace(load_profile("tpu-v4"), sources=("a,b", "c, d"))
  save_profile(p, tmp_path / "s.json")
  assert load_profile(tmp_path / "s.json").sources == ("a,b", "c, d")


@pytest.mark.parametrize("edit,message", [
    (lambda d: d["topology"].update(kind="ring"), "field 'topology.kind' must be one of"),
    (lambda d: d["topology"].update(link_bandwidth=0), "field 'topology.link_bandwidth' must "
                                                       "be > 0"),
    (lambda d: d["topology"].update(efficiency=[1, 1]), "field 'topology.efficiency' must be "
                                                        "3 numbers"),
    (lambda d: d["topology"].update(hops=3), "field 'topology' has an unknown key 'hops'"),
    (lambda d: d["topology"].pop("kind"), "missing field 'topology.kind'"),
    (lambda d: d["topology"].update(dcn_bandwidth=-1), "field 'topology.dcn_bandwidth' must "
                                                       "be a number >= 0"),
])
def test_malformed_topology(tmp_path, edit, message):
  path = _broken(tmp_path, edit)
  with pytest.raises(ValueError) as e:
    load_profile(path)
  assert message in str(e.value)


def test_accumulate_fields_validate(tmp_path):
  data = load_profile("h100").to_json_dict()
  assert (data["accumulate_bytes"], data["accumulate_fused"]) == (16.0, False)
  data["accumulate_fused"] = "no"
  path = tmp_path / "p.json"
  path.write_text(json.dumps(data))
  with pytest.raises(ValueError, match="field 'accumulate_fused' must be true or false"):
    load_profile(path)
