"""The one HLO text parser (meshslice.costmodel.hlo_text) on small hand-written texts, with
hand-derived values: element sizes, loops of any step and direction, escaped-quote
backend configs, comments, strings, and replica groups in every spelling; and both of its
readers (`meshslice.hlo`, `costmodel.tpu_schedule`) agreeing on the same text.
"""
import pytest

from meshslice import hlo
from meshslice.costmodel import hlo_text
from meshslice.costmodel import tpu_schedule as ts


def _entry(*lines: str, partitions: int = 4, extra: str = "") -> str:
  body = "\n".join("  " + line for line in lines)
  return (f"HloModule m, is_scheduled=true, num_partitions={partitions}\n\n{extra}"
          f"ENTRY %main (p: f32[8,8]) -> f32[8,8] {{\n{body}\n}}\n")


# ----------------------------------------------------------------------------- types

@pytest.mark.parametrize("type_text,size", [
    ("s4[64,64]{1,0}", 2048),              # 4096 half-bytes
    ("u4[6]{0}", 3),
    ("f8e4m3fnuz[10]{0}", 10),
    ("f8e5m2fnuz[10]{0}", 10),
    ("f8e4m3b11fnuz[10]{0}", 10),
    ("f8e4m3fn[10]{0}", 10),
    ("token[]", 0),
    ("pred[8]{0}", 8),
    ("c128[2]{0}", 32),
    ("f32[]", 4),                          # a scalar: one element
    ("(s4[8]{0}, token[], bf16[2,2]{1,0})", 4 + 0 + 8),
    ("(s32[], /*index=1*/f32[8,8]{1,0})", 4 + 256),
])
def test_bytes_of_every_element_type(type_text, size):
  assert hlo_text.nbytes(type_text) == size


def test_narrow_types_move_bytes_in_both_readers():
  """s4 / u4 / fnuz f8 counted 0 bytes in meshslice.hlo before the parsers were one."""
  text = _entry(
      "%p = f32[8,8]{1,0} parameter(0)",
      "%a = s4[64,64]{1,0} bitcast(%p)",
      "%b = f8e4m3fnuz[64,64]{1,0} bitcast(%p)",
      "%ag = s4[256,64]{1,0} all-gather(%a), channel_id=1, replica_groups={{0,1,2,3}}, "
      "dimensions={0}",
      "%ar = f8e4m3fnuz[64,64]{1,0} all-reduce(%b), channel_id=2, replica_groups={{0,1,2,3}}, "
      "to_apply=%add",
      "ROOT %r = f32[8,8]{1,0} copy(%p)")
  stats = hlo.collective_stats(text)
  # s4[256,64] = 8192 B, * 3/4 = 6144; f8[64,64] = 4096 B, * 2 * 3/4 = 6144
  assert stats["bytes"]["all-gather"] == 6144.0
  assert stats["bytes"]["all-reduce"] == 6144.0
  assert ts.summarize(text).collective_bytes == {"all-gather": 6144.0, "all-reduce": 6144.0}


def test_collective_output_type_of_async_starts():
  assert hlo_text.collective_output_type(
      "all-gather-start", "(f32[8,8]{1,0}, f32[32,8]{1,0})") == "f32[32,8]{1,0}"
  assert hlo_text.collective_output_type(
      "collective-permute-start", "(f32[8]{0}, f32[8]{0}, u32[], u32[])") == "f32[8]{0}"
  assert hlo_text.collective_output_type("all-reduce-start", "f32[8]{0}") == "f32[8]{0}"
  assert hlo_text.collective_output_type("all-gather", "f32[32]{0}") == "f32[32]{0}"
  assert [hlo_text.collective_kind(op) for op in (
      "all-gather", "reduce-scatter-start", "all-gather-done", "fusion")] == [
          "all-gather", "reduce-scatter", None, None]


def test_moved_bytes_rule():
  # a 1024 B result over 4 devices: ring volumes of docs/costmodel.md
  assert [hlo_text.moved_bytes(k, 1024, 4) for k in hlo_text.COLLECTIVES] == [
      768.0, 3072.0, 1536.0, 768.0, 1024.0]
  # a group of one moves nothing, except a permute (its pair is not a group)
  assert [hlo_text.moved_bytes(k, 1024, 1) for k in hlo_text.COLLECTIVES] == [
      0.0, 0.0, 0.0, 0.0, 1024.0]
  with pytest.raises(ValueError, match="unknown collective 'broadcast'"):
    hlo_text.moved_bytes("broadcast", 1024, 4)


# ----------------------------------------------------------------------------- loops

_LOOP = """HloModule loop, num_partitions=4

%body (s: (s32[], f32[8,8])) -> (s32[], f32[8,8]) {{
  %s = (s32[], f32[8,8]{{1,0}}) parameter(0)
  %i = s32[] get-tuple-element(%s), index=0
  %x = f32[8,8]{{1,0}} get-tuple-element(%s), index=1
  %ag = f32[32,8]{{1,0}} all-gather(%x), replica_groups={{{{0,1,2,3}}}}, dimensions={{0}}
  %sl = f32[8,8]{{1,0}} slice(%ag), slice={{[0:8], [0:8]}}
  %step = s32[] constant({step})
  %next = s32[] {update}(%i, %step)
  ROOT %out = (s32[], f32[8,8]{{1,0}}) tuple(%next, %sl)
}}

%cond (s: (s32[], f32[8,8])) -> pred[] {{
  %s = (s32[], f32[8,8]{{1,0}}) parameter(0)
  %i = s32[] get-tuple-element(%s), index=0
  %n = s32[] constant({bound})
  ROOT %c = pred[] compare({compared}), direction={direction}
}}

ENTRY %main (p0: f32[8,8]) -> f32[8,8] {{
  %p0 = f32[8,8]{{1,0}} parameter(0)
  %start = s32[] constant({start})
  %init = (s32[], f32[8,8]{{1,0}}) tuple(%start, %p0)
  %w = (s32[], f32[8,8]{{1,0}}) while(%init), condition=%cond, body=%body{attrs}
  ROOT %r = f32[8,8]{{1,0}} get-tuple-element(%w), index=1
}}
"""


def _loop(start, direction, bound, update="add", step=1, attrs="", compared="%i, %n"):
  return _LOOP.format(start=start, direction=direction, bound=bound, update=update,
                      step=step, attrs=attrs, compared=compared)


@pytest.mark.parametrize("text,trips", [
    (_loop(0, "LT", 4), 4),                               # 0, 1, 2, 3
    (_loop(1, "LT", 4), 3),                               # 1, 2, 3
    (_loop(0, "LT", 9, step=2), 5),                       # 0, 2, 4, 6, 8
    (_loop(0, "LE", 9, step=3), 4),                       # 0, 3, 6, 9
    (_loop(5, "GE", 0, update="subtract"), 6),            # 5, 4, 3, 2, 1, 0
    (_loop(7, "GT", 0, update="subtract", step=2), 4),    # 7, 5, 3, 1
    (_loop(2, "NE", 8, step=2), 3),                       # 2, 4, 6
    (_loop(0, "GT", 4, compared="%n, %i"), 4),            # 4 > i: i < 4
    (_loop(0, "LT", 4, update="add", step=-1), None),     # never ends: not recognised
    (_loop(1, "NE", 8, step=2), None),                    # steps over the bound
])
def test_trip_counts_of_any_step_and_direction(text, trips):
  assert hlo.while_trip_counts(text) == {"w": trips}
  loop, = ts.read_schedule(text).loops()
  assert (loop.trip_count, loop.trip_count_known) == (trips or 1, trips is not None)
  # the body's all-gather (f32[32,8] over 4: 768 B) runs once per trip (once if unknown)
  stats = hlo.collective_stats(text)
  assert (stats["count"]["all-gather"], stats["bytes"]["all-gather"]) == (
      trips or 1, 768.0 * (trips or 1))
  assert ts.summarize(text).collective_count == {"all-gather": trips or 1}


def test_stated_trip_count_in_escaped_quotes_wins():
  """backend_config printed as a string of escaped JSON: the stated 6 trips, not the 4
  the condition gives."""
  text = _loop(0, "LT", 4, attrs=', backend_config="{\\"known_trip_count\\":{\\"n\\":\\"6\\"}}"')
  assert '\\"known_trip_count\\"' in text
  assert hlo.while_trip_counts(text) == {"w": 6}
  assert ts.read_schedule(text).loops()[0].trip_count == 6
  plain = _loop(0, "LT", 4, attrs=', backend_config={"known_trip_count":{"n":"7"}}')
  assert hlo.while_trip_counts(plain) == {"w": 7}
  assert ts.read_schedule(plain).loops()[0].trip_count == 7


# ----------------------------------------------------------------------------- text

def test_comments_are_dropped_strings_are_not_calls():
  text = _entry(
      "%p = f32[8,8]{1,0} parameter(0)",
      "%t = (f32[8,8]{1,0}, /*index=1*/f32[8,8]{1,0}) tuple(%p, /*index=1*/%p), "
      'metadata={op_name="jit(f)/while/body=%fake calls=%fake2 /*kept*/"}',
      "ROOT %r = f32[8,8]{1,0} get-tuple-element(%t), index=1")
  module = hlo_text.parse(text)
  t = module.computations["main"].instrs["t"]
  assert t.type_text == "(f32[8,8]{1,0}, f32[8,8]{1,0})"
  assert t.operands == ("p", "p")
  assert "/*kept*/" in t.attrs                   # a comment inside a string is text
  assert t.called() == {}                         # body= / calls= inside a string
  assert hlo_text.strip_comments('a /*x*/ b "c /*y*/"') == 'a  b "c /*y*/"'


def test_module_attributes_and_fragments():
  module = hlo_text.parse("HloModule m, is_scheduled=true, num_partitions=4, "
                          "replica_count=2\n\nENTRY %e () -> f32[] {\n"
                          "  ROOT %c = f32[] constant(1)\n}\n")
  assert (module.entry, module.num_partitions, module.replica_count, module.is_scheduled,
          module.devices) == ("e", 4, 2, True, 8)
  assert module.computations["e"].root == "c" and module.loose is None
  loose = hlo_text.parse("%a = f32[8]{0} add(%b, %c)")
  assert loose.entry is None and loose.computations == {}
  assert list(loose.loose.instrs) == ["a"] and loose.loose.instrs["a"].operands == ("b", "c")


def test_unoptimized_text_with_bare_names():
  """Lowered HLO (`as_text(dialect="hlo")`) prints operands without `%`, maybe typed."""
  module = hlo_text.parse("HloModule m\n\nENTRY main.1 {\n"
                          "  x.1 = f32[8]{0} parameter(0)\n"
                          "  c.2 = f32[] constant(2)\n"
                          "  b.3 = f32[8]{0} broadcast(c.2), dimensions={}\n"
                          "  ROOT m.4 = f32[8]{0} multiply(f32[8]{0} x.1, /*index=1*/b.3)\n}\n")
  instrs = module.computations["main.1"].instrs
  assert instrs["m.4"].operands == ("x.1", "b.3")
  assert instrs["c.2"].operands == () and instrs["c.2"].args == "2"
  assert hlo_text.split_top_level("a, (b, c), {d, e}, [f, g]") == [
      "a", "(b, c)", "{d, e}", "[f, g]"]
  assert hlo_text.close_paren("a, f(b)), rest") == 7


# ----------------------------------------------------------------------------- groups

@pytest.mark.parametrize("groups,first", [
    ("replica_groups={{0,1},{2,3}}", (0, 1)),
    ("replica_groups={{0, 2}, {1, 3}}", (0, 2)),
    ("replica_groups=[2,2]<=[4]", (0, 1)),
    ("replica_groups=[2,2]<=[2,2]T(1,0)", (0, 2)),
    ("replica_groups={}", (0, 1, 2, 3)),                   # every device of the module
    ("replica_groups=mesh['x'=2,'y'=2] {'y'}", (0, 1)),
    ("replica_groups=mesh['x'=2,'y'=2] {'x'}", (0, 2)),
    ("replica_groups=mesh[x=2,y=2] {x}", (0, 2)),
    ("replica_groups=mesh['x'=2,'y'=2] {'x','y'}", (0, 1, 2, 3)),
    # the mesh's devices in mesh order [[0, 2], [1, 3]]: y along a row
    ("replica_groups=mesh['x'=2,'y'=2], device_ids=(0,2,1,3) {'y'}", (0, 2)),
    ("replica_groups=mesh['x'=2,'y'=2] device_ids=([2,2]<=[2,2]T(1,0)) {'y'}", (0, 2)),
    ("replica_groups=mesh['x'=2,'y'=2], device_ids=([2,2]T(1,0)) {'x'}", (0, 1)),
    # sub-axis (p)k of an axis of n: [p, k, n/(p k)] major to minor, the group along k
    ("replica_groups=mesh['x'=4] {'x':(2)2}", (0, 1)),
    ("replica_groups=mesh['x'=4] {'x':(1)2}", (0, 2)),
    ("source_target_pairs={{0,1},{1,0}}", (0, 1)),
    ("dimensions={0}", ()),
])
def test_replica_groups_in_every_spelling(groups, first):
  assert hlo_text.replica_group(f"{groups}, dimensions={{0}}", 4) == first


def test_both_readers_agree_on_every_spelling():
  spellings = ["{{0,1},{2,3}}", "[2,2]<=[4]", "[2,2]<=[2,2]T(1,0)", "{}",
               "mesh['x'=2,'y'=2] {'y'}", "mesh[x=2,y=2] {y}",
               "mesh['x'=2,'y'=2], device_ids=(0,2,1,3) {'y'}", "mesh['x'=4] {'x':(2)2}"]
  lines = ["%p = f32[8,8]{1,0} parameter(0)"] + [
      f"%ag{i} = f32[32,8]{{1,0}} all-gather(%p), channel_id={i}, replica_groups={g}, "
      "dimensions={0}" for i, g in enumerate(spellings)] + [
      "ROOT %r = f32[8,8]{1,0} copy(%p)"]
  text = _entry(*lines)
  # groups of 2 (f32[32,8] = 1024 B * 1/2) but `{}`: all 4 devices (* 3/4)
  expected = 7 * 512.0 + 768.0
  assert hlo.collective_stats(text)["bytes"]["all-gather"] == expected
  assert ts.summarize(text).collective_bytes == {"all-gather": expected}
  assert sum(op.moved_bytes for op in ts.read_schedule(text).expanded()) == expected
  pairs = hlo_text.source_target_pairs("source_target_pairs={{0,1},{1,2},{2,3},{3,0}}")
  assert pairs == ((0, 1), (1, 2), (2, 3), (3, 0))


def test_old_names_of_the_compiled_schedule():
  assert ts.Schedule is ts.CompiledSchedule and ts.Op is ts.CompiledOp
  assert ts.COLLECTIVES == hlo.KINDS == hlo_text.COLLECTIVES
