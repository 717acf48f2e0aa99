"""Differential fuzzer of the meshslice pass: N random examples, outcome counts.

Each example is a random sharded `dot_general` (or, with --kind=program, a small
differentiated program of 2-4 dots) on a random CPU mesh with random options; it runs
`meshslice.transform(step)`, plain `jax.jit(step)` and an unsharded single-device
reference on the same inputs. The generators are tests/fuzzing.py's (shared with the
in-suite hypothesis tests, tests/test_fuzz.py). Outcomes:

  match             nothing rewritten, values and gradients equal the reference
  rewritten-match   at least one site rewritten, values and gradients equal the reference
  wrong             the transformed program disagrees with the unsharded reference
  crash             meshslice.transform raised (for valid options)
  invalid-option    strict=True and the pass refused an option the site cannot honour
  jax-rejects       plain jax refuses the program (e.g. Explicit-mode sharding rules):
                    not a valid test of the pass

It also counts sites left alone grouped by reason, and examples on which plain jit
itself disagrees with the unsharded reference (GSPMD bugs on CPU), and prints the first
--show repro scripts of each distinct failure class.

  python bench/fuzz.py --examples 2000 --seed 0
  python bench/fuzz.py --examples 50 --kind program --show 1
"""
from __future__ import annotations

import collections
import os
import re
import sys
import time
import warnings

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
from absl import app, flags  # noqa: E402

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 8)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import fuzzing  # noqa: E402
from hypothesis import HealthCheck, Phase, given, seed, settings  # noqa: E402

EXAMPLES = flags.DEFINE_integer("examples", 200, "random examples to run")
SEED = flags.DEFINE_integer("seed", 0, "random seed (same seed, same examples)")
KIND = flags.DEFINE_enum("kind", "dot", ["dot", "program"], "what to generate")
SHOW = flags.DEFINE_integer("show", 2, "repro scripts printed per failure class")
COMPARE_PLAIN = flags.DEFINE_bool("compare_plain", False,
                                  "always run plain jit too (else only when needed)")
REPRO_DIR = flags.DEFINE_string("repro_dir", "", "write one repro script per failure "
                                "class into this directory")


def failure_class(outcome) -> str:
  """A short signature grouping failures with the same cause."""
  first = outcome.detail.split("\n", 1)[0]
  first = re.sub(r"float\d+\[[^\]]*\]|bfloat16\[[^\]]*\]", "ARR", first)
  first = re.sub(r"P\([^)]*\)+", "P(..)", first)
  first = re.sub(r"rel [0-9.e+-]+", "rel E", first)
  first = re.sub(r"\d+", "N", first)
  if outcome.kind == "wrong":
    case = outcome.case
    layout = "explicit" if case.explicit else "auto"
    return f"wrong ({layout}): {first[:140]}"
  return f"{outcome.kind}: {first[:160]}"


def run(n, seed_value, kind, compare_plain):
  outcomes = []
  runner = fuzzing.run_dot_case if kind == "dot" else fuzzing.run_program_case
  strategy = fuzzing.dot_cases() if kind == "dot" else fuzzing.program_cases()

  @seed(seed_value)
  @settings(max_examples=n, deadline=None, database=None, phases=(Phase.generate,),
            suppress_health_check=list(HealthCheck))
  @given(strategy)
  def body(case):
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")
      outcomes.append(runner(case, compare_plain=compare_plain))
    if len(outcomes) % 50 == 0:
      print(f"# {len(outcomes)} examples", file=sys.stderr, flush=True)

  try:
    body()
  except KeyboardInterrupt:    # Ctrl-C: report what ran so far
    print(f"# interrupted after {len(outcomes)} examples", file=sys.stderr)
  return outcomes


def report(outcomes, seconds, show, repro_dir=""):
  kinds = collections.Counter(o.kind for o in outcomes)
  print(f"{len(outcomes)} examples in {seconds:.0f} s "
        f"({seconds / max(len(outcomes), 1):.2f} s each)")
  for k in fuzzing.KINDS:
    print(f"  {k:16s} {kinds.get(k, 0)}")
  print(f"  plain jit disagreed with the unsharded reference (GSPMD): "
        f"{sum(o.gspmd_wrong for o in outcomes)}")
  reasons = collections.Counter(r for o in outcomes for r in o.left_alone)
  print(f"sites left alone, by reason ({sum(reasons.values())} sites):")
  for reason, count in reasons.most_common():
    print(f"  {count:6d}  {reason}")
  rejects = collections.Counter(failure_class(o) for o in outcomes if o.kind == "jax-rejects")
  if rejects:
    print("programs plain jax rejects, by error:")
    for reason, count in rejects.most_common(8):
      print(f"  {count:6d}  {reason}")
  classes = collections.defaultdict(list)
  for o in outcomes:
    if o.failed:
      classes[failure_class(o)].append(o)
  print(f"failure classes: {len(classes)}")
  for i, (name, members) in enumerate(sorted(classes.items(), key=lambda kv: -len(kv[1]))):
    print(f"\n=== [{i}] {len(members)}x {name}")
    for o in members[:show]:
      print(o.case.describe())
      print(o.detail.split("\nTraceback", 1)[0][:600])
      print("--- repro ---")
      print(o.case.repro())
    if repro_dir:
      os.makedirs(repro_dir, exist_ok=True)
      with open(os.path.join(repro_dir, f"fuzz_class_{i:02d}.py"), "w") as f:
        f.write(f"# {len(members)}x {name}\n" + members[0].case.repro())
  return kinds


def main(argv):
  del argv
  start = time.perf_counter()
  outcomes = run(EXAMPLES.value, SEED.value, KIND.value, COMPARE_PLAIN.value)
  report(outcomes, time.perf_counter() - start, SHOW.value, REPRO_DIR.value)


if __name__ == "__main__":
  app.run(main)
