"""The pin rule (meshslice_pass/pins.py): every pinned key, on every kind of site, is
honoured, noted on the site, or an error naming where it was pinned, the key and the
site; and saved plans are as strict about their keys as overrides are.

Only planning runs here (`meshslice.explain` on ShapeDtypeStructs): nothing compiles.
"""
import functools
import inspect
import json
import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import meshslice
from meshslice import pins
from meshslice.errors import PinError, PlanError
from meshslice.options import SiteRequest

from helpers import mesh

SEE = "see the site indexes and sources with print(meshslice.explain(fn)(*args))"
NO_COMMUNICATION = ("no communication needed: axis x, y splits only one operand's free "
                    "dims (runs locally)")
BATCH_ONLY = "no mesh axis shards a non-batch dim (nothing to communicate)"


def _abstract(*specs, dtype=jnp.float32):
  msh = mesh((2, 4))
  return tuple(jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(msh, spec))
               for shape, spec in specs)


def _line(fn, offset) -> str:
  return f"test_pin_rules.py:{inspect.getsourcelines(fn)[1] + offset}"


def _left_alone_program(x, w, a, b, v):
  y = x @ w                                    # site 0: no communication needed
  z = jnp.einsum("bij,bjk->bik", a, b)         # site 1: only the batch dim is sharded
  return jnp.sum(y) + jnp.sum(z) + jnp.sum(x @ v)   # site 2: os, rewritten


LEFT_ALONE_ARGS = _abstract(((64, 32), P("x", None)), ((32, 64), P(None, "y")),
                            ((8, 16, 16), P("x")), ((8, 16, 16), P("x")),
                            ((32, 64), P("x", "y")))


def _explain(fn, args, **options):
  return meshslice.explain(jax.jit(fn), **options)(*args)


@functools.cache
def _label(index: int) -> str:
  """'site #k (<source>)' of `_left_alone_program`'s site (the source as the report
  writes it: relative to the working directory)."""
  site = _explain(_left_alone_program, LEFT_ALONE_ARGS).sites[index]
  assert site.source.endswith(_line(_left_alone_program, 1 + min(index, 2)))
  return site.label


def _mlp_grads(x, w1, w2):
  return jnp.sum(jnp.tanh(x @ w1) @ w2)


# sites: 0, 1 forward (os); 2 and 4 weight gradients (rs, swapped); 3 data gradient (ls)
MLP_ARGS = _abstract(((16, 64), P("x", "y")), ((64, 128), P("x", "y")),
                     ((128, 64), P("x", "y")))
MLP = jax.grad(_mlp_grads, argnums=(1, 2))


# ---------------------------------------------------------------- the table itself

def test_the_rule_table_is_what_makes_a_pin_key():
  """A key is a pin key by having a rule: overrides and plans accept exactly the table's
  keys, and each is a setting of the per-site request the rule judges."""
  assert pins.PIN_KEYS == tuple(pins.PIN_RULES) == (
      "algorithm", "dataflow", "ksplit", "rewrite", "reduce_scatter", "hold_gathers")
  fields = {f for f in SiteRequest.__dataclass_fields__}
  assert set(pins.PIN_KEYS) <= fields
  with pytest.raises(PinError, match=re.escape(
      "overrides[0] has unknown key 'hold_gather' (did you mean 'hold_gathers'?); allowed: "
      "algorithm, dataflow, ksplit, rewrite, reduce_scatter, hold_gathers")):
    meshslice.transform(lambda a: a, overrides={0: {"hold_gather": True}})


# ------------------------------------------------- class A: every key, every site kind

PINS = [{"algorithm": "collective"}, {"dataflow": "os"}, {"ksplit": 2}, {"rewrite": True},
        {"reduce_scatter": "all_to_all"}, {"reduce_scatter": "reduce_scatter"},
        {"hold_gathers": True}, {"hold_gathers": False}]


@pytest.mark.parametrize("index, reason", [(0, NO_COMMUNICATION), (1, BATCH_ONLY)])
@pytest.mark.parametrize("pin", PINS, ids=lambda p: "=".join(map(str, *p.items())))
def test_every_pin_on_a_site_left_alone_is_an_error(index, reason, pin):
  (name, value), = pin.items()
  label = _label(index)
  with pytest.raises(PinError) as e:
    _explain(_left_alone_program, LEFT_ALONE_ARGS, overrides={index: pin})
  assert str(e.value) == (
      f"overrides[{index}] pins {name}={value!r} on {label}, which cannot be rewritten: "
      f"{reason}. Remove the pin (or pin {{'rewrite': False}}); {SEE}")


@pytest.mark.parametrize("index", [0, 1])
def test_leaving_a_left_alone_site_alone_is_honoured(index):
  report = _explain(_left_alone_program, LEFT_ALONE_ARGS, overrides={index: {"rewrite": False}})
  assert not report.sites[index].rewritten and report.sites[index].pin_notes == ()


def test_a_pins_own_rewrite_false_notes_its_other_keys():
  report = _explain(_left_alone_program, LEFT_ALONE_ARGS, overrides={2: {
      "rewrite": False, "reduce_scatter": "all_to_all", "hold_gathers": True}})
  site = report.sites[2]
  assert not site.rewritten
  notes = ("overrides[2]: reduce_scatter='all_to_all' not used: the site is left alone as "
           "requested (rewrite=False)",
           "overrides[2]: hold_gathers=True not used: the site is left alone as requested "
           "(rewrite=False)")
  assert site.pin_notes == notes and site.note.endswith("; ".join(notes))
  row = next(line for line in str(report).splitlines() if line.startswith("2 "))
  assert row.endswith("left alone as requested (override or plan); " + "; ".join(notes))


def test_a_rewrite_false_pinned_elsewhere_makes_the_sites_other_pins_errors():
  plan = _explain(_left_alone_program, LEFT_ALONE_ARGS).plan.edit(2, rewrite=False)
  label = _label(2)
  with pytest.raises(PinError) as e:
    _explain(_left_alone_program, LEFT_ALONE_ARGS, plan=plan,
             overrides={2: {"hold_gathers": True, "reduce_scatter": "all_to_all"}})
  assert str(e.value) == (
      f"overrides[2] pins reduce_scatter='all_to_all', hold_gathers=True on {label}, which "
      "is left alone as requested by plan site #2 (rewrite=False). Remove the pin, or the "
      f"rewrite=False of plan site #2; {SEE}")


def test_pins_a_rewritten_site_does_not_take_are_noted_by_its_own_pin():
  report = _explain(MLP, MLP_ARGS, overrides={
      0: {"hold_gathers": False, "reduce_scatter": "all_to_all"},
      1: {"algorithm": "collective", "ksplit": 2},
      2: {"hold_gathers": True, "reduce_scatter": "all_to_all"},
      3: {"reduce_scatter": "all_to_all", "hold_gathers": True}})
  sites = report.sites
  assert [(s.rewritten, s.dataflow, s.swapped) for s in sites] == [
      (True, "os", False), (True, "os", False), (True, "rs", True), (True, "ls", False),
      (True, "rs", True)]
  assert sites[0].pin_notes == (
      "overrides[0]: reduce_scatter='all_to_all' not used: only the ls / rs sites of "
      "meshslice and collective take it (this is collective os)",
      "overrides[0]: hold_gathers=False not used: only weight gradients (sites with swapped "
      "operands) hold their gathers back")
  assert (sites[1].algorithm, sites[1].ksplit) == ("collective", 1)
  assert sites[1].pin_notes == (
      "overrides[1]: ksplit=2 not used: the collective algorithm (overrides[1]) does not "
      "slice; pin algorithm='meshslice' as well to slice this site",)
  assert (sites[2].reduce_scatter, sites[2].hold_gathers, sites[2].pin_notes) == (
      "all_to_all", True, ())
  assert sites[3].reduce_scatter == "all_to_all"
  assert sites[3].pin_notes == (
      "overrides[3]: hold_gathers=True not used: only weight gradients (sites with swapped "
      "operands) hold their gathers back",)
  assert all(note in s.note for s in sites for note in s.pin_notes)


def _twins(x, w, v):
  return jnp.sum(x @ w) + jnp.sum(x @ v)       # sites 0 and 1: the same matmul


TWIN_ARGS = _abstract(((16, 64), P("x", "y")), ((64, 32), P("x", "y")),
                      ((64, 32), P("x", "y")))


def test_each_site_notes_its_own_pin_where_sites_share_a_decision():
  """Equal sites are planned once; the note still names the pin on each of them."""
  report = _explain(_twins, TWIN_ARGS, overrides={0: {"hold_gathers": True},
                                                 1: {"hold_gathers": True}})
  assert [s.pin_notes for s in report.sites] == [
      (f"overrides[{i}]: hold_gathers=True not used: only weight gradients (sites with "
       "swapped operands) hold their gathers back",) for i in (0, 1)]


def _with_a_left_alone_line(x, w1, w2, r):
  return jnp.sum(jnp.tanh(x @ w1) @ w2) + jnp.sum(x @ r)


def test_a_pin_on_several_sites_must_be_taken_by_one_of_them():
  """A 'file:line' or module-pattern pin: its error on a site is a note there when another
  site it matches takes it, and an error when none does."""
  fn = jax.value_and_grad(_with_a_left_alone_line, argnums=(1, 2))
  args = MLP_ARGS + _abstract(((64, 8), P()))
  line = _line(_with_a_left_alone_line, 1)
  report = _explain(fn, args, overrides={line: {"hold_gathers": True}})
  alone = [s for s in report.sites if not s.rewritten]
  assert [s.index for s in alone] == [2]
  assert alone[0].pin_notes == (f"overrides[{line!r}]: hold_gathers=True not used: the site "
                                "cannot be rewritten (see its reason)",)
  assert [s.index for s in report.sites if s.hold_gathers] == [3, 5]
  row = next(r for r in str(report).splitlines() if r.startswith("2 "))
  assert row.endswith(f"{alone[0].reason}; {alone[0].pin_notes[0]}")
  # a line whose only matmul cannot be rewritten
  line = _line(_left_alone_program, 1)
  with pytest.raises(PinError) as e:
    _explain(_left_alone_program, LEFT_ALONE_ARGS,
             overrides={line: {"reduce_scatter": "all_to_all"}})
  assert str(e.value) == (
      f"overrides[{line!r}] pins reduce_scatter='all_to_all' on {_label(0)}, which "
      f"cannot be rewritten: {NO_COMMUNICATION}. Remove the pin (or pin "
      f"{{'rewrite': False}}); {SEE}")


def test_a_pin_on_a_site_left_to_xla_is_an_error_that_says_rewrite_true():
  fn = lambda x, w: x @ w      # noqa: E731
  args = _abstract(((16384, 12288), P("x", "y")), ((12288, 49152), P("y", "x")),
                   dtype=jnp.bfloat16)
  site = _explain(fn, args).sites[0]
  assert site.reason.startswith("left to XLA: the best rewrite (meshslice ls S=3)")
  with pytest.raises(PinError) as e:
    _explain(fn, args, overrides={0: {"reduce_scatter": "all_to_all"}})
  assert str(e.value) == (
      f"overrides[0] pins reduce_scatter='all_to_all' on {site.label}, which is not "
      f"rewritten: {site.reason}. Pin {{'rewrite': True}} as well to rewrite it anyway, or "
      f"remove the pin; {SEE}")
  pinned = _explain(fn, args, overrides={0: {"reduce_scatter": "all_to_all",
                                             "rewrite": True}}).sites[0]
  assert (pinned.rewritten, pinned.dataflow, pinned.reduce_scatter, pinned.pin_notes) == (
      True, "ls", "all_to_all", ())


def test_an_edited_left_alone_plan_entry_pins_only_what_the_edit_says():
  plan = _explain(_left_alone_program, LEFT_ALONE_ARGS).plan
  assert plan.edit(0, algorithm="collective").pin_for(0) == {"algorithm": "collective"}
  with pytest.raises(PinError) as e:
    _explain(_left_alone_program, LEFT_ALONE_ARGS, plan=plan.edit(0, hold_gathers=True))
  assert str(e.value) == (
      f"plan site #0 pins hold_gathers=True on {_label(0)}, which cannot be rewritten: "
      f"{NO_COMMUNICATION}. Remove the pin (or pin {{'rewrite': False}}); {SEE}")


# ---------------------------------------------------- class B: plans as strict as pins

ENTRY_KEYS = ("algorithm, baseline_seconds, dataflow, edited, hold_gathers, index, ksplit, "
              "module, path, predicted_seconds, reduce_scatter, rewrite, rewritten, source")


def _tuned_like_plan():
  """A plan as `meshslice.tune` leaves it: left-alone sites pinned rewrite=False, a
  weight gradient held, the reduce-scatters as all-to-alls, one site edited."""
  report = _explain(MLP, MLP_ARGS, reduce_scatter="all_to_all")
  plan = report.plan.edit(0, rewrite=False).edit(2, hold_gathers=True)
  return plan.edit(1, algorithm="meshslice", ksplit=2)


@pytest.mark.parametrize("key, value, near", [("hold_gather", True, "hold_gathers"),
                                              ("reduce_scater", "all_to_all", "reduce_scatter"),
                                              ("ksplits", 2, "ksplit")])
def test_misspelled_site_keys_are_errors(tmp_path, key, value, near):
  data = json.loads(_tuned_like_plan().to_json())
  data["sites"][2][key] = value
  path = tmp_path / "plan.json"
  path.write_text(json.dumps(data))
  with pytest.raises(PlanError) as e:
    meshslice.Plan.load(str(path))
  assert str(e.value) == (
      f"plan file {str(path)!r}: sites[2] (site #2) has unknown key {key!r} (did you mean "
      f"{near!r}?); allowed: {ENTRY_KEYS}")
  with pytest.raises(PlanError, match=re.escape(
      f"plan: sites[2] (site #2) has unknown key {key!r} (did you mean {near!r}?)")):
    meshslice.Plan.from_json(json.dumps(data))
  with pytest.raises(PlanError, match=re.escape(
      f"plan file {str(path)!r}: sites[2] (site #2) has unknown key {key!r}")):
    meshslice.transform(MLP, plan=str(path))


def test_misspelled_top_level_keys_are_errors():
  data = json.loads(_tuned_like_plan().to_json())
  data["site"] = data.pop("sites")
  with pytest.raises(PlanError) as e:
    meshslice.Plan.from_json(json.dumps(data), where="plan file 'p.json'")
  assert str(e.value) == ("plan file 'p.json' has unknown key 'site' (did you mean "
                          "'sites'?); allowed: mesh_shape, sites, version")
  data = json.loads(_tuned_like_plan().to_json())
  data["sites"][0]["note"] = "reviewed"
  with pytest.raises(PlanError) as e:
    meshslice.Plan.from_json(json.dumps(data))
  assert str(e.value) == (f"plan: sites[0] (site #0) has unknown key 'note'; allowed: "
                          f"{ENTRY_KEYS}")


def test_every_plan_the_project_saves_loads_and_applies_the_same(tmp_path):
  plan = _tuned_like_plan()
  path = tmp_path / "plan.json"
  plan.save(str(path))
  loaded = meshslice.Plan.load(str(path))
  assert loaded == plan and loaded.to_json() == plan.to_json()
  assert {k for e in loaded.sites for k in e} >= {"edited", "rewrite", "hold_gathers",
                                                  "reduce_scatter"}
  report = _explain(MLP, MLP_ARGS, plan=loaded)
  assert [(s.rewritten, s.algorithm, s.ksplit, s.reduce_scatter, s.hold_gathers)
          for s in report.sites] == [
      (False, None, None, None, None), (True, "meshslice", 2, None, None),
      (True, "collective", 1, "all_to_all", True), (True, "collective", 1, "all_to_all", None),
      (True, "collective", 1, "all_to_all", None)]
  assert all(s.pin_notes == () for s in report.sites)
  again = report.plan
  assert meshslice.Plan.from_json(again.to_json()) == again
