"""`python -m meshslice calibrate` (and its --aot mode), run in-process through
meshslice.__main__.main: every bad option is refused with a usage error naming it
(exit 2, no traceback) before JAX starts and before anything is measured or compiled."""
import os

import pytest

from meshslice import aot, calibrate_aot
from meshslice.__main__ import main
from meshslice.costmodel import calibrate, known_profiles

KNOWN = ", ".join(known_profiles())
UNKNOWN_PROFILE = ("unknown hardware profile {!r}; known profiles: " + KNOWN
                   + " (or pass the path of a profile JSON file)")


class Reached(Exception):
  """Raised by the stand-ins of the measuring and compiling entry points."""


@pytest.fixture
def no_work(monkeypatch):
  """Starting JAX, measuring and compiling fail the test: options are checked first."""
  def forbidden(what):
    def fail(*args, **kwargs):
      raise Reached(f"{what} ran before the options were checked")
    return fail
  monkeypatch.setattr(calibrate, "_start_jax", forbidden("JAX start"))
  monkeypatch.setattr(calibrate, "measure_collectives", forbidden("measure_collectives"))
  monkeypatch.setattr(calibrate, "measure_gemms", forbidden("measure_gemms"))
  monkeypatch.setattr(calibrate_aot, "compile_in_subprocess", forbidden("compiling"))


def refused(capsys, argv, prog="python -m meshslice calibrate") -> str:
  """Run `calibrate argv`; it must stop with a usage error. Returns the message."""
  with pytest.raises(SystemExit) as exit_:
    main(["calibrate", *argv])
  assert exit_.value.code == 2
  err = capsys.readouterr().err
  assert err.startswith("usage: ") and "Traceback" not in err
  last = err.rstrip("\n").splitlines()[-1]
  assert last.startswith(f"{prog}: error: "), err
  return last[len(f"{prog}: error: "):]


def _id(value):
  """Test ids: the arguments, not the expected message."""
  return " ".join(value) if isinstance(value, list) else "-"


@pytest.fixture
def out(tmp_path):
  return str(tmp_path / "p.json")


# ----------------------------------------------------------------------------- calibrate

@pytest.mark.parametrize("argv, message", ids=_id, argvalues=[
    (["--loops", "0"], "--loops must be a positive integer, got 0"),
    (["--repeats", "-1"], "--repeats must be a positive integer, got -1"),
    (["--gemm-base", "0"], "--gemm-base must be a positive integer, got 0"),
    (["--gemm-min", "-4"], "--gemm-min must be a positive integer, got -4"),
    (["--gemm-base", "64", "--gemm-min", "64"],
     "--gemm-min must be at most half of --gemm-base (32), so that more than one GEMM "
     "shape is timed; got 64"),
])
def test_counts(no_work, capsys, out, argv, message):
  assert refused(capsys, ["--out", out, *argv]) == message


@pytest.mark.parametrize("argv, message", ids=_id, argvalues=[
    (["--hop-ratio", "-1"],
     "--hop-ratio must be a finite number >= 0 (hop_latency / base_overhead), got -1"),
    (["--hop-ratio", "nan"],
     "--hop-ratio must be a finite number >= 0 (hop_latency / base_overhead), got nan"),
    (["--peak-flops", "0"],
     "--peak-flops must be a finite number > 0 (FLOP/s per device), got 0"),
    (["--peak-flops", "inf"],
     "--peak-flops must be a finite number > 0 (FLOP/s per device), got inf"),
])
def test_ratios_and_rates(no_work, capsys, out, argv, message):
  assert refused(capsys, ["--out", out, *argv]) == message


def test_dtype(no_work, capsys, out):
  assert refused(capsys, ["--out", out, "--dtype", "nope"]) == (
      "--dtype must be one of float32, bfloat16, float16, got 'nope'")


@pytest.mark.parametrize("name, message", [
    ("tpu-v44", "--base-profile: " + UNKNOWN_PROFILE.format("tpu-v44")
     + "; did you mean 'tpu-v4'?"),
    ("nope", "--base-profile: " + UNKNOWN_PROFILE.format("nope")),
])
def test_base_profile(no_work, capsys, out, name, message):
  assert refused(capsys, ["--out", out, "--base-profile", name]) == message


def test_base_profile_file_that_is_missing(no_work, capsys, out, tmp_path):
  path = str(tmp_path / "mine.json")
  message = refused(capsys, ["--out", out, "--base-profile", path])
  assert message.startswith(f"--base-profile: hardware profile {path!r}: cannot read it")


@pytest.mark.parametrize("argv, message", ids=_id, argvalues=[
    (["--cpu-devices", "0"], "--cpu-devices must be a positive integer, got 0"),
    (["--num-processes", "2"], "--num-processes only applies with --distributed"),
    (["--coordinator-address", "10.0.0.1:1234"],
     "--coordinator-address only applies with --distributed"),
    (["--distributed", "--num-processes", "0"],
     "--num-processes must be a positive integer, got 0"),
    (["--distributed", "--process-id", "-1"],
     "--process-id must be a non-negative integer, got -1"),
    (["--distributed", "--num-processes", "2", "--process-id", "2"],
     "--process-id must be below --num-processes (2), got 2"),
    (["--distributed", "--coordinator-address", "10.0.0.1"],
     "--coordinator-address must be host:port (e.g. 10.0.0.1:1234), got '10.0.0.1'"),
])
def test_devices_and_processes(no_work, capsys, out, argv, message):
  assert refused(capsys, ["--out", out, *argv]) == message


@pytest.mark.parametrize("argv, message", ids=_id, argvalues=[
    (["--mesh", "2x0"], "--mesh must be RxC with positive R and C (e.g. 2x4), got '2x0'"),
    (["--mesh", "8"], "--mesh must be RxC with positive R and C (e.g. 2x4), got '8'"),
    (["--sizes-kib", "16"], "--sizes-kib must be >= 2 distinct positive shard sizes in KiB, "
                            "comma-separated (e.g. 16,64,256), got '16'"),
    (["--sizes-kib", "inf,16"], "--sizes-kib must be >= 2 distinct positive shard sizes in "
                                "KiB, comma-separated (e.g. 16,64,256), got 'inf,16'"),
    (["--kinds", "all_gathr"], "--kinds must be drawn from all_gather, reduce_scatter, "
                               "permute (comma-separated), got 'all_gathr'; did you mean "
                               "'all_gather'?"),
    (["--kinds", ","], "--kinds names no collective; give some of all_gather, "
                       "reduce_scatter, permute, or --skip-collectives"),
    (["--name", " "], "--name must be a non-empty profile name, got ' '"),
])
def test_what_is_measured(no_work, capsys, out, argv, message):
  assert refused(capsys, ["--out", out, *argv]) == message


def test_output_paths(no_work, capsys, tmp_path, monkeypatch):
  missing = str(tmp_path / "no" / "such" / "p.json")
  assert refused(capsys, ["--out", missing]) == (
      f"--out {missing!r}: directory {os.path.dirname(missing)!r} does not exist "
      "(create it first)")
  assert refused(capsys, ["--out", str(tmp_path)]) == (
      f"--out {str(tmp_path)!r} is a directory; give a file name in it, e.g. "
      f"{str(tmp_path / 'profile.json')!r}")
  assert refused(capsys, ["--out", str(tmp_path / "p.txt")]) == (
      "--out must name a .json file (the suffix by which load_profile tells a profile file "
      f"from a shipped profile's name), got {str(tmp_path / 'p.txt')!r}")
  out = str(tmp_path / "p.json")
  assert refused(capsys, ["--out", out, "--report", out]) == (
      f"--report must differ from --out (both {out!r})")
  report = str(tmp_path / "no" / "r.json")
  assert refused(capsys, ["--out", out, "--report", report]) == (
      f"--report {report!r}: directory {os.path.dirname(report)!r} does not exist "
      "(create it first)")
  monkeypatch.setattr(os, "access", lambda path, mode: False)   # as if read-only
  assert refused(capsys, ["--out", out]) == f"--out {out!r}: not writable"


def test_valid_options_reach_the_measurement(monkeypatch, out):
  def reached(*args, **kwargs):
    raise Reached
  monkeypatch.setattr(calibrate, "measure_collectives", reached)
  with pytest.raises(Reached):
    main(["calibrate", "--out", out, "--report", out[:-5] + "-report.json",
          "--dtype", "bfloat16", "--hop-ratio", "0", "--base-profile", "cpu",
          "--gemm-base", "64", "--gemm-min", "32", "--loops", "1", "--repeats", "1"])


# ----------------------------------------------------------------------------- calibrate --aot

AOT = "python -m meshslice calibrate --aot"


@pytest.mark.parametrize("argv, message", ids=_id, argvalues=[
    (["--aot", "v9:2x2"], "--aot: topology 'v9:2x2': unknown TPU generation 'v9'; known: "
                          + ", ".join(aot.GENERATIONS)),
    (["--aot", "v4:2x2x2", "--mesh", "2x2"],
     "--mesh must be RxC with R * C = 8 (the devices of v4:2x2x2), got '2x2'"),
    (["--aot", "v4:2x2x2", "--shapes", "4096x4096"],
     "--shapes must be GEMM sizes MxKxN of positive integers, comma-separated "
     "(e.g. 4096x4096x4096), got '4096x4096'"),
    (["--aot", "v4:2x2x2", "--shapes", "4096x0x4096"],
     "--shapes must be GEMM sizes MxKxN of positive integers, comma-separated "
     "(e.g. 4096x4096x4096), got '4096x0x4096'"),
    (["--aot", "v4:2x2x2", "--shapes", "4096x4098x4096"],
     "--shapes: 4096x4098x4096 does not shard over the 2x4 mesh: K must be a multiple of 4 "
     "(dataflows os,ls,rs)"),
    # the rule follows the dataflows: rs shards M over C (operand) and R (output); with
    # os only, M is sharded over R alone and 4098 would do
    (["--aot", "v4:2x2x2", "--shapes", "4098x4096x4096", "--dataflows", "os,rs"],
     "--shapes: 4098x4096x4096 does not shard over the 2x4 mesh: M must be a multiple of 4 "
     "(dataflows os,rs)"),
])
def test_aot_topology_mesh_and_shapes(no_work, capsys, out, argv, message):
  assert refused(capsys, ["--out", out, *argv], prog=AOT) == message


@pytest.mark.parametrize("argv, message", ids=_id, argvalues=[
    (["--ksplits", "0,2"],
     "--ksplits must be positive integers, comma-separated (e.g. 1,2,4), got '0,2'"),
    (["--ksplits", "two"],
     "--ksplits must be positive integers, comma-separated (e.g. 1,2,4), got 'two'"),
    (["--dataflows", "os,xs"],
     "--dataflows must be drawn from os, ls, rs (comma-separated), got 'os,xs'"),
    (["--profile", "tpu-v44"],
     "--profile: " + UNKNOWN_PROFILE.format("tpu-v44") + "; did you mean 'tpu-v4'?"),
])
def test_aot_counts_dataflows_and_profile(no_work, capsys, out, argv, message):
  assert refused(capsys, ["--out", out, "--aot", "v4:2x2x2", *argv], prog=AOT) == message


def test_aot_output_paths(no_work, capsys, tmp_path):
  missing = str(tmp_path / "no" / "p.json")
  assert refused(capsys, ["--aot", "v4:2x2x2", "--out", missing], prog=AOT) == (
      f"--out {missing!r}: directory {os.path.dirname(missing)!r} does not exist "
      "(create it first)")
  bare = str(tmp_path / "p")
  assert refused(capsys, ["--aot", "v4:2x2x2", "--out", bare], prog=AOT) == (
      "--out must name a .json file (the suffix by which load_profile tells a profile file "
      f"from a shipped profile's name), got {bare!r}")
  out = str(tmp_path / "p.json")
  assert refused(capsys, ["--aot", "v4:2x2x2", "--out", out, "--records", out],
                 prog=AOT) == f"--records must differ from --out (both {out!r})"


def test_aot_valid_options_reach_the_compiler(monkeypatch, out):
  def reached(*args, **kwargs):
    raise Reached
  monkeypatch.setattr(calibrate_aot, "compile_in_subprocess", reached)
  monkeypatch.setattr(aot, "have_libtpu", lambda: True)
  with pytest.raises(Reached):
    calibrate_aot.calibrate_main(["--aot", "v4:2x2x2", "--out", out, "--mesh", "4x2",
                                  "--shapes", "2048x2048x2048", "--ksplits", "1,2",
                                  "--dataflows", "os,rs", "--profile", "tpu-v4"])
