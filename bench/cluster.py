"""Flags and start-up shared by the bench apps: emulated CPU devices, and
`jax.distributed.initialize()` for multi-host runs (TPU pods, GPU clusters).

Each app does `import cluster` (bench/ is on sys.path when it runs as a script) and
calls `cluster.start()` first thing in `main`.
"""
import json
import os

import jax
from absl import flags

CPU_DEVICES = flags.DEFINE_integer("cpu_devices", 8, "emulated devices when on CPU")
DISTRIBUTED = flags.DEFINE_bool(
    "distributed", False, "call jax.distributed.initialize() first: on Cloud TPU pods and "
    "under SLURM / Open MPI / Kubernetes it detects the job itself; elsewhere pass the next "
    "three flags")
COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None, "host:port of process 0 (or set JAX_COORDINATOR_ADDRESS)")
NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "processes in the job")
PROCESS_ID = flags.DEFINE_integer("process_id", None, "this process's index")


def start():
  """Ask for the emulated CPU devices (if JAX has not started yet) and join the job."""
  try:
    jax.config.update("jax_num_cpu_devices", CPU_DEVICES.value)
  except RuntimeError:
    pass                                    # JAX already started (e.g. a caller did)
  if DISTRIBUTED.value:
    kwargs = {k: v for k, v in (("coordinator_address", COORDINATOR.value),
                                ("num_processes", NUM_PROCESSES.value),
                                ("process_id", PROCESS_ID.value)) if v is not None}
    jax.distributed.initialize(**kwargs)


def write_jsonl(path, records):
  """Write one JSON object per line (sorted keys, so files diff cleanly) and say so."""
  with open(path, "w", encoding="utf-8") as f:
    for r in records:
      f.write(json.dumps(r, sort_keys=True) + "\n")
  print(f"{len(records)} records written to {path}")


def run_flag_set(script: str, flag_set: str, **flag_values) -> list:
  """`run_json_worker(script, ["--worker=flag_set", "--name=value", ...])`: absl strips
  the flags it parsed from argv, so a worker gets this run's values passed explicitly
  (lists joined with commas)."""
  args = [f"--worker={flag_set}"] + [
      f"--{name}={','.join(map(str, v)) if isinstance(v, (list, tuple)) else v}"
      for name, v in flag_values.items()]
  return run_json_worker(script, args)


def run_json_worker(script: str, args) -> list:
  """Run `script` with `args` in a fresh Python process (libtpu reads its flags once per
  process, so each flag set compiles in its own; `meshslice.aot.run_in_fresh_process`)
  and return the JSON objects it prints, one per line. XLA_FLAGS is not passed on (it
  would ask a TPU compile for CPU devices)."""
  from meshslice import aot
  try:
    return aot.run_in_fresh_process([script, *args], check=bool)
  except aot.FreshProcessError as e:
    raise RuntimeError(f"{os.path.basename(script)} {' '.join(args)} failed:\n"
                       f"{e.stderr[-3000:]}") from None


def print_json_lines(records) -> None:
  """A worker's answer to `run_json_worker`: one JSON object per line on stdout."""
  for record in records:
    print(json.dumps(record), flush=True)


def require_libtpu() -> None:
  """Stop with a usage error when libtpu (the TPU compiler) is not installed."""
  from absl import app
  from meshslice import aot
  if not aot.have_libtpu():
    raise app.UsageError("needs libtpu: pip install -e '.[tpu]'")
