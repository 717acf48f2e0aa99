"""Strict, helpful inputs (issue 19, deliverable 4).

- A profile JSON with an unknown key is an error naming the file and the key, with the
  nearest known key (`"overlapp": false` used to load with overlap=True).
- A profile file holding a JSON list (or another non-object), or a field of the wrong
  type, names the file and the field (used to be a bare AttributeError / TypeError).
- Every error about a bad pin inside `overrides=` names `overrides[<key>]`.
- The shipped profiles and what `save_profile` / `calibrate` write keep loading.
"""
import json
import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import meshslice
from meshslice.costmodel import known_profiles, load_profile, save_profile, xla_baseline

from helpers import mesh

_TOP_KEYS = ("accumulate_bytes, accumulate_fused, collectives, compiler_terms, "
             "core_link_bandwidth, description, devices_per_chip, gemm_efficiency, "
             "hbm_bandwidth, hbm_capacity, name, op_overhead, overlap, "
             "peak_flops, serial_collectives, sources, topology, units")


def _write(tmp_path, data, name="mine.json"):
  path = tmp_path / name
  path.write_text(json.dumps(data))
  return str(path)


def _profile(edit, base="cpu"):
  data = load_profile(base).to_json_dict()
  edit(data)
  return data


# ------------------------------------------------------------------- unknown keys

def test_misspelt_top_level_key_is_an_error_with_the_nearest_key(tmp_path):
  path = _write(tmp_path, _profile(lambda d: d.update(overlapp=False)))
  message = (f"hardware profile {path!r}: an unknown key 'overlapp'; did you mean 'overlap'? "
             f"(known keys: {_TOP_KEYS})")
  with pytest.raises(ValueError) as e:
    load_profile(path)
  assert str(e.value) == message
  # through the options, as a user meets it
  with pytest.raises(ValueError) as e:
    meshslice.transform(lambda a: a, profile=path)
  assert str(e.value) == f"profile: {message}"
  with pytest.raises(ValueError) as e:
    meshslice.explain(lambda a: a, profile=path)
  assert str(e.value) == f"profile: {message}"


@pytest.mark.parametrize("edit,message", [
    (lambda d: d.update(Peak_Flops=1.0),
     f"an unknown key 'Peak_Flops'; did you mean 'peak_flops'? (known keys: {_TOP_KEYS})"),
    (lambda d: d.update(hops=3), f"an unknown key 'hops' (known keys: {_TOP_KEYS})"),
    (lambda d: d["collectives"].update(allgather=d["collectives"]["all_gather"]),
     "field 'collectives' has an unknown key 'allgather'; did you mean 'all_gather'? "
     "(known keys: all_gather, permute, reduce_scatter)"),
    (lambda d: d["collectives"]["permute"].update(bandwith=[1e9, 1e9]),
     "field 'collectives.permute' has an unknown key 'bandwith'; did you mean 'bandwidth'? "
     "(known keys: bandwidth, base_overhead, hop_latency)"),
    (lambda d: d["gemm_efficiency"].update(M_sat=8.0),
     "field 'gemm_efficiency' has an unknown key 'M_sat'; did you mean 'm_sat'? "
     "(known keys: k_sat, m_sat, max_efficiency, n_sat)"),
    (lambda d: d["topology"].update(link_bandwith=1e9),
     "field 'topology' has an unknown key 'link_bandwith'; did you mean 'link_bandwidth'? "
     "(known keys: dcn_bandwidth, dcn_latency, efficiency, island_size, kind, "
     "link_bandwidth, max_chips, physical_dims, wrap_min_chips, wrap_min_length)"),
])
def test_unknown_keys_anywhere_name_the_file_and_the_key(tmp_path, edit, message):
  path = _write(tmp_path, _profile(edit, base="tpu-v4"))
  with pytest.raises(ValueError) as e:
    load_profile(path)
  assert str(e.value) == f"hardware profile {path!r}: {message}"


def test_calibrated_section_unknown_key(tmp_path):
  path = str(tmp_path / "v4-compiled.json")
  xla_baseline.write_terms(path, load_profile("tpu-v4"), xla_baseline.builtin_terms("tpu-v4"))
  data = json.loads(open(path).read())
  data["compiler_terms"]["dot_effciency"] = data["compiler_terms"].pop("dot_efficiency")
  _write(tmp_path, data, "v4-compiled.json")
  with pytest.raises(ValueError) as e:
    meshslice.transform(lambda a: a, profile=path)
  assert str(e.value) == (
      f"profile: hardware profile {path!r}: field 'compiler_terms' has an unknown key "
      "'dot_effciency'; did you mean 'dot_efficiency'? (known keys: allreduce_max_block, "
      "async_fraction, dot_efficiency, dot_fixed_s, extra_scale, last_allreduce_min_bytes, "
      "source, version, windowed_dot_factor, windowed_min_bytes, windowed_min_ring, "
      "windowed_out_s, windowed_ring_hidden)")


# ------------------------------------------------------------- wrong JSON types

@pytest.mark.parametrize("content,kind", [([], "list"), ([{"name": "cpu"}], "list"),
                                          ("cpu", "string"), (3, "number"), (None, "null")])
def test_profile_file_that_is_not_an_object(tmp_path, content, kind):
  path = _write(tmp_path, content)
  message = (f"hardware profile {path!r}: must hold a JSON object of profile fields (name, "
             f"peak_flops, collectives, gemm_efficiency, ...), got a JSON {kind}")
  with pytest.raises(ValueError) as e:
    load_profile(path)
  assert str(e.value) == message
  # today: AttributeError 'list' object has no attribute 'get' (the terms reader)
  with pytest.raises(ValueError) as e:
    meshslice.transform(lambda a: a, profile=path)
  assert str(e.value) == f"profile: {message}"


@pytest.mark.parametrize("edit,message", [
    (lambda d: d.update(collectives=[]), "field 'collectives' must be a JSON object, got []"),
    (lambda d: d["collectives"].update(permute="fast"),
     "field 'collectives.permute' must be a JSON object, got 'fast'"),
    (lambda d: d.update(gemm_efficiency=0.9),
     "field 'gemm_efficiency' must be a JSON object, got 0.9"),
    (lambda d: d.update(topology=[]), "field 'topology' must be a JSON object, got []"),
    (lambda d: d.update(compiler_terms=[]),
     "field 'compiler_terms' must be a JSON object, got []"),
    (lambda d: d.update(overlap="no"), "field 'overlap' must be true or false, got 'no'"),
])
def test_wrong_field_types_name_the_file_and_the_field(tmp_path, edit, message):
  path = _write(tmp_path, _profile(edit, base="tpu-v4"))
  with pytest.raises(ValueError) as e:
    meshslice.transform(lambda a: a, profile=path)
  assert str(e.value) == f"profile: hardware profile {path!r}: {message}"


@pytest.mark.parametrize("edit,message", [
    (lambda t: t.update(async_fraction=[]),
     "field 'compiler_terms.async_fraction' must be a JSON object, got []"),
    (lambda t: t["async_fraction"].update(os=0.5),
     "field 'compiler_terms.async_fraction.os' must be a JSON object, got 0.5"),
])
def test_calibrated_section_wrong_types(tmp_path, edit, message):
  path = str(tmp_path / "v4-compiled.json")
  xla_baseline.write_terms(path, load_profile("tpu-v4"), xla_baseline.builtin_terms("tpu-v4"))
  data = json.loads(open(path).read())
  edit(data["compiler_terms"])
  _write(tmp_path, data, "v4-compiled.json")
  # today: AttributeError: 'list' object has no attribute 'get'
  with pytest.raises(ValueError) as e:
    meshslice.transform(lambda a: a, profile=path)
  assert str(e.value) == f"profile: hardware profile {path!r}: {message}"


# ------------------------------------------------------------- valid files still load

@pytest.mark.parametrize("name", known_profiles())
def test_shipped_profiles_and_their_saved_copies_load(tmp_path, name):
  profile = load_profile(name)
  path = str(tmp_path / f"{name}.json")
  save_profile(profile, path)
  assert load_profile(path) == profile
  opts = meshslice.Options.from_kwargs("transform", {"profile": path})
  assert opts.profile == profile
  # a calibrated file (`calibrate --aot` writes the profile plus its terms)
  terms = xla_baseline.builtin_terms("tpu-v4")
  xla_baseline.write_terms(path, profile, terms)
  assert load_profile(path) == profile
  assert meshslice.Options.from_kwargs("transform", {"profile": path}).compiler_terms == terms


def test_older_files_without_optional_fields_still_load(tmp_path):
  data = load_profile("tpu-v4").to_json_dict()
  for key in ("hbm_bandwidth", "hbm_capacity", "op_overhead", "sources", "units", "overlap",
              "accumulate_bytes", "accumulate_fused", "serial_collectives", "description",
              "topology"):
    data.pop(key)
  assert load_profile(_write(tmp_path, data)).name == "tpu-v4"


# ------------------------------------------------------------------- overrides

@pytest.mark.parametrize("overrides,message", [
    ({0: {"ksplit": 0}},
     "overrides[0]: ksplit must be a positive int (1 = no slicing) or None for automatic, "
     "got 0"),
    ({2: {"ksplit": "2"}},
     "overrides[2]: ksplit must be a positive int (1 = no slicing) or None for automatic, "
     "got '2'"),
    ({"model.py:41": {"ksplit": 2.0}},
     "overrides['model.py:41']: ksplit must be a positive int (1 = no slicing) or None for "
     "automatic, got 2.0"),
    ({"*/Dense_1": {"ksplit": True}},
     "overrides['*/Dense_1']: ksplit must be a positive int (1 = no slicing) or None for "
     "automatic, got True"),
    ({0: {"algorithm": "nope"}},
     "overrides[0]: algorithm must be one of 'meshslice', 'collective', 'cannon', 'wang', "
     "'summa' (or None for automatic), got 'nope'"),
    ({"*/MlpBlock_*/*": {"algorithm": "Meshslice"}},
     "overrides['*/MlpBlock_*/*']: algorithm must be one of 'meshslice', 'collective', "
     "'cannon', 'wang', 'summa' (or None for automatic), got 'Meshslice'; did you mean "
     "'meshslice'?"),
    ({0: {"dataflow": "LS"}},
     "overrides[0]: dataflow must be one of 'os', 'ls', 'rs', got 'LS'; did you mean 'ls'?"),
    ({0: {"kslpit": 2}},
     "overrides[0] has unknown key 'kslpit' (did you mean 'ksplit'?); allowed: algorithm, "
     "dataflow, ksplit, rewrite, reduce_scatter, hold_gathers"),
    ({0: {"hold_gathers": "yes"}},
     "overrides[0]: hold_gathers must be True or False, got 'yes'"),
])
def test_every_override_error_names_its_key(overrides, message):
  with pytest.raises(ValueError) as e:
    meshslice.transform(lambda a: a, overrides=overrides)
  assert str(e.value) == message
  with pytest.raises(ValueError) as e:
    meshslice.explain(lambda a: a, overrides=overrides)
  assert str(e.value) == message


def test_global_option_errors_keep_their_names():
  with pytest.raises(ValueError) as e:
    meshslice.transform(lambda a: a, ksplit=0)
  assert str(e.value) == ("ksplit must be a positive int (1 = no slicing) or None for "
                          "automatic, got 0")


def test_site_request_says_which_override_pinned_each_setting():
  opts = meshslice.Options.from_kwargs("transform", {"overrides": {
      0: {"ksplit": 2}, "*/Mlp*": {"algorithm": "collective"}, "m.py:3": {"dataflow": "ls"}}})
  request = opts.request_for(index=0, source="pkg/m.py:3", module="top/MlpBlock")
  assert (request.ksplit, request.algorithm, request.dataflow) == (2, "collective", "ls")
  assert request.pinned_by("ksplit") == "overrides[0]"
  assert request.pinned_by("algorithm") == "overrides['*/Mlp*']"
  assert request.pinned_by("dataflow") == "overrides['m.py:3']"
  assert request.pinned_by("rewrite") == ""
  # the origin does not split planning decisions: equal settings, equal requests
  opts = meshslice.Options.from_kwargs("transform", {"overrides": {0: {"ksplit": 2},
                                                                   1: {"ksplit": 2}}})
  first, second = (opts.request_for(index=i, source="", module="") for i in (0, 1))
  assert first == second and hash(first) == hash(second)
  assert (first.pinned_by("ksplit"), second.pinned_by("ksplit")) == ("overrides[0]",
                                                                      "overrides[1]")


def _program():
  msh = mesh((2, 4))
  s = NamedSharding(msh, P("x", "y"))
  x = jax.device_put(jnp.ones((32, 64)), s)
  w = jax.device_put(jnp.ones((64, 128)), s)
  return jax.jit(lambda x, w: x @ w), x, w


@pytest.mark.parametrize("pin,start", [
    ({"ksplit": 3}, "overrides[0]: ksplit=3 does not fit site #0 ("),
    ({"algorithm": "cannon"}, "overrides[0]: algorithm='cannon' cannot serve site #0 ("),
])
def test_pins_a_site_cannot_honour_name_the_override(pin, start):
  f, x, w = _program()
  with pytest.raises(ValueError, match="^" + re.escape(start)):
    meshslice.explain(f, overrides={0: pin})(x, w)


@pytest.mark.parametrize("text, message", [
    ("{overrides: 1}", "--options: not JSON (Expecting property name enclosed in double "
                       "quotes: line 1 column 2 (char 1))"),
    ("[1, 2]", "--options: a JSON object of transform options is needed, got list"),
])
def test_options_from_json_names_the_flag(text, message):
  from meshslice.options import options_from_json
  with pytest.raises(ValueError) as e:
    options_from_json(text, "--options")
  assert str(e.value) == message


def test_options_from_json_takes_digit_keys_as_site_indices():
  from meshslice.options import options_from_json
  options = options_from_json('{"overrides": {"24": {"dataflow": "ls"}, " 3 ": {}, '
                              '"model.py:41": {"ksplit": 2}}, "relayout": false}')
  assert options == {"overrides": {24: {"dataflow": "ls"}, 3: {},
                                   "model.py:41": {"ksplit": 2}}, "relayout": False}
  meshslice.transform(lambda x: x, **options)          # and transform takes them
