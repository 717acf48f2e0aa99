"""The one fresh-process worker protocol of the AOT tooling (`aot.run_in_fresh_process`:
libtpu reads its flags once per process) and its three callers, `aot_sites`, the `aot`
CLI and bench/cluster.py, each with its own error messages."""
import json
import os
import sys

import pytest

from meshslice import aot, aot_cli, aot_sites

_BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")


def _code(*lines):
  return ["-c", "\n".join(lines)]


def test_records_are_the_prefixed_json_lines_and_the_rest_is_echoed(monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
  monkeypatch.setenv("F3_KEPT", "kept")
  monkeypatch.setenv("F3_DROPPED", "dropped")
  echoed = []
  records = aot.run_in_fresh_process(_code(
      "import json, os",
      "print('progress 1')",
      "print('RECORD ' + json.dumps({'xla': os.environ.get('XLA_FLAGS'),",
      "                              'kept': os.environ.get('F3_KEPT'),",
      "                              'dropped': os.environ.get('F3_DROPPED')}))",
      "print()",
      "print('{\"not\": \"a record without the prefix\"}')"),
      prefix="RECORD ", echo=echoed.append, drop_env=("XLA_FLAGS", "F3_DROPPED"))
  assert records == [{"xla": None, "kept": "kept", "dropped": None}]
  assert echoed == ["progress 1\n", "\n", '{"not": "a record without the prefix"}\n']
  # no prefix: every line that is a JSON object; XLA_FLAGS is dropped by default
  assert aot.run_in_fresh_process(_code(
      "import os; print({'a': 1}.__repr__().replace(\"'\", '\"')); print('text');"
      "print('{\"xla\": %d}' % ('XLA_FLAGS' in os.environ))")) == [{"a": 1}, {"xla": 0}]


def test_a_failed_worker_raises_with_its_exit_status_and_output():
  with pytest.raises(aot.FreshProcessError) as caught:
    aot.run_in_fresh_process(_code(
        "import sys", "print('some output')", "print('{\"x\": 1}')",
        "print('the reason', file=sys.stderr)", "sys.exit(3)"))
  e = caught.value
  assert isinstance(e, RuntimeError) and e.returncode == 3 and not e.timed_out
  assert e.stdout == 'some output\n{"x": 1}\n' and e.stderr == "the reason\n"
  assert "exit 3" in str(e) and "the reason" in str(e)


def test_check_refuses_records_as_a_failure():
  assert aot.run_in_fresh_process(_code("print('nothing')")) == []
  with pytest.raises(aot.FreshProcessError) as caught:
    aot.run_in_fresh_process(_code("print('nothing')"), check=bool)
  assert caught.value.returncode == 0 and caught.value.stdout == "nothing\n"


def test_a_worker_past_the_timeout_is_killed():
  with pytest.raises(aot.FreshProcessError) as caught:
    aot.run_in_fresh_process(_code("import os, sys, time", "print('RECORD {}', flush=True)",
                                   "sys.stdout.close(); os.close(1)", "time.sleep(30)"),
                             prefix="RECORD ", timeout=0.5)
  assert caught.value.timed_out and caught.value.returncode is None


def test_a_worker_writing_much_to_stderr_does_not_stall():
  """stderr is read beside stdout: a worker filling the stderr pipe (libtpu's warnings)
  before it prints its records still finishes."""
  records = aot.run_in_fresh_process(_code(
      "import sys", "sys.stderr.write('w' * 1_000_000); sys.stderr.flush()",
      "print('{\"done\": true}')"), timeout=60)
  assert records == [{"done": True}]


# ----------------------------------------------------------------------------- callers

def test_compile_in_subprocess_runs_the_aot_sites_worker(monkeypatch):
  seen = {}

  def fake(argv, **kwargs):
    seen.update(argv=argv, **kwargs)
    for line in ("  os  xla  async  1.0 Mcycles\n", "\n", "   \n"):
      kwargs["echo"](line)
    return [{"program": "xla"}]

  monkeypatch.setattr(aot, "run_in_fresh_process", fake)
  echoed = []
  cases = [aot_sites.Case(dataflow="os", m=256, k=256, n=256)]
  records = aot_sites.compile_in_subprocess("v4:2x2x1", (2, 2), cases, "async", ksplits=(2,),
                                            timeout=7, echo=echoed.append)
  assert records == [{"program": "xla"}]
  assert echoed == ["  os  xla  async  1.0 Mcycles"]          # blank lines dropped
  assert seen["argv"][:2] == ["-m", "meshslice.aot_sites"]
  assert json.loads(seen["argv"][2]) == {
      "topology": "v4:2x2x1", "mesh": [2, 2], "flag_set": "async", "ksplits": [2],
      "cases": [{"dataflow": "os", "m": 256, "k": 256, "n": 256, "dtype": "bfloat16",
                 "label": ""}]}
  assert seen["prefix"] == "RECORD " and seen["timeout"] == 7
  assert "drop_env" not in seen                                  # XLA_FLAGS only


@pytest.mark.parametrize("timed_out", [False, True])
def test_compile_in_subprocess_failures_keep_their_messages(monkeypatch, timed_out):
  def fake(argv, **kwargs):
    raise aot.FreshProcessError(argv, None if timed_out else 4, "", "x" * 5000 + "why",
                                timed_out=timed_out)

  monkeypatch.setattr(aot, "run_in_fresh_process", fake)
  with pytest.raises(RuntimeError) as caught:
    aot_sites.compile_in_subprocess("v4:2x2x1", (2, 2), [], "dense", timeout=9)
  if timed_out:
    assert str(caught.value) == "dense compiles timed out after 9 s"
  else:
    assert str(caught.value) == "dense compiles failed (exit 4):\n" + ("x" * 2997 + "why")
  assert caught.value.__suppress_context__


def _cluster():
  sys.path.insert(0, _BENCH)
  try:
    import cluster
  finally:
    sys.path.remove(_BENCH)
  return cluster


def test_cluster_json_workers(tmp_path, monkeypatch):
  cluster = _cluster()
  monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
  script = tmp_path / "worker.py"
  script.write_text("import json, os, sys\n"
                    "print('libtpu chatter')\n"
                    "if sys.argv[1] == 'fail':\n"
                    "  print('it broke', file=sys.stderr); sys.exit(1)\n"
                    "if sys.argv[1] == 'ok':\n"
                    "  print(json.dumps({'args': sys.argv[1:],\n"
                    "                    'xla': os.environ.get('XLA_FLAGS')}))\n"
                    "print('no records', file=sys.stderr)\n")
  assert cluster.run_json_worker(str(script), ["ok", "--n=1"]) == [
      {"args": ["ok", "--n=1"], "xla": None}]
  for mode, err in (("fail", "it broke\n"), ("empty", "no records\n")):
    with pytest.raises(RuntimeError) as caught:
      cluster.run_json_worker(str(script), [mode, "--n=1"])
    assert str(caught.value) == f"worker.py {mode} --n=1 failed:\n{err}"
    assert not isinstance(caught.value, aot.FreshProcessError)


def _cli_row(step_ms):
  return {"compute_cycles": 1e6, "dot_cycles": 1e6, "copy_cycles": 0, "relayout_copies": 0,
          "collectives": 2, "sync_collectives": 1, "async_collectives": 1,
          "collective_bytes": 1e6, "windowed_einsum_loops": 0, "step_s": step_ms / 1e3,
          "compute_s": 1e-3, "exposed_s": 0.0, "peak_bytes": 2**30, "compile_s": 1.0,
          "flags": ""}


def _fake_cli_worker(fail=None, calls=None):
  """A stand-in for the `--variant` worker processes: prints a report and writes its
  row to --json, or fails as `fail` ({variant: (exit status, writes the row?)}) says."""
  def fake(argv, *, prefix, echo, check, drop_env):
    variant = next(a.split("=", 1)[1] for a in argv if a.startswith("--variant="))
    out = next(a.split("=", 1)[1] for a in argv if a.startswith("--json="))
    if calls is not None:
      calls.append((argv, prefix, drop_env))
    status, writes = (fail or {}).get(variant, (0, True))
    if writes:
      with open(out, "w") as f:
        json.dump(_cli_row(2.0 if variant == "meshslice" else 3.0), f)
    stdout = f"report of {variant}\n"
    if status or not check([]):
      raise aot.FreshProcessError(argv, status, stdout, f"trace of {variant}\n")
    echo(stdout)
    return []
  return fake


def test_aot_cli_runs_each_variant_in_a_fresh_process(monkeypatch, capsys):
  calls = []
  monkeypatch.setattr(aot_cli, "have_libtpu", lambda: True)
  monkeypatch.setattr(aot_cli, "run_in_fresh_process", _fake_cli_worker(calls=calls))
  assert aot_cli.main(["--topology=v4:2x2x1", "--mesh=2x2", "--seq=128",
                       "--variants=plain,meshslice"]) == 0
  out = capsys.readouterr().out
  assert "report of meshslice\n" in out and "report of plain" not in out
  assert "meshslice vs the best XLA variant (plain, 3.000 ms): 1.500x (faster)" in out
  argv, prefix, drop_env = calls[0]
  assert argv[:3] == ["-m", "meshslice", "aot"] and "--variant=plain" in argv
  assert "--seq=128" in argv and drop_env == ("XLA_FLAGS", "LIBTPU_INIT_ARGS")
  # the rewrite's default presets are the generation's: on v4 async all-to-all too, so
  # that reduce-scatters overlap as all-to-alls and meshslice_dense compiles under the
  # step template's flags; XLA's variants get the async flags alone
  assert "--flags=async,all_to_all" in argv
  head = out[:out.index("report of meshslice")]        # the flags listed before compiling
  listed = dict(l.strip().split(": ", 1) for l in head.splitlines()
                if l.startswith(("  plain: ", "  meshslice: ")))
  assert listed["meshslice"] == " ".join(aot.preset_flags("async,all_to_all", "v4"))
  assert listed["plain"] == "(libtpu defaults)"


def test_aot_cli_default_flags_follow_the_generation(monkeypatch, capsys):
  calls = []
  monkeypatch.setattr(aot_cli, "have_libtpu", lambda: True)
  monkeypatch.setattr(aot_cli, "run_in_fresh_process", _fake_cli_worker(calls=calls))
  for topology, presets in (("v5p:2x2x1", "async"), ("tpu7x:2x2x1", "async"),
                            ("v4:2x2x1", "dense,async")):       # given: taken as given
    calls.clear()
    given = [f"--flags={presets}"] if presets == "dense,async" else []
    assert aot_cli.main([f"--topology={topology}", "--mesh=2x2", "--variants=meshslice",
                         *given]) == 0
    assert f"--flags={presets}" in calls[0][0], (topology, calls[0][0])
  capsys.readouterr()


@pytest.mark.parametrize("variant,status,writes,printed", [
    ("plain", 1, True, True), ("plain", 0, False, False), ("meshslice", 0, False, True)])
def test_aot_cli_reports_a_failed_variant(monkeypatch, capsys, variant, status, writes,
                                          printed):
  monkeypatch.setattr(aot_cli, "have_libtpu", lambda: True)
  monkeypatch.setattr(aot_cli, "run_in_fresh_process",
                      _fake_cli_worker(fail={variant: (status, writes)}))
  assert aot_cli.main(["--topology=v4:2x2x1", "--mesh=2x2", f"--variants={variant}"]) == 2
  captured = capsys.readouterr()
  assert (f"report of {variant}\n" in captured.out) == printed
  assert captured.err == f"error: variant {variant} failed (exit {status}):\ntrace of {variant}\n\n"
