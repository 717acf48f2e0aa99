"""Hardware profiles: what one chip computes and how fast each mesh axis communicates.

A profile is data (a frozen dataclass, saved as JSON under `profiles/`). The formulas
that turn it into seconds live in `timing.py`; this module only holds, validates, loads
and saves the numbers.

Units (also written into every JSON file under "units"). "Per device" is per jax device:
a chip on every generation but one (v4 / v5p compile as megacore chips, v5e / v6e have
one TensorCore); on TPU7x (Ironwood, `devices_per_chip` 2) each of a chip's two
TensorCores is its own device, and the per-device figures are the chip's halves.

  peak_flops                      FLOP/s per device (the matmul peak the model divides by)
  <collective>.bandwidth          bytes/s per device, [mesh dim 0, mesh dim 1]
  <collective>.hop_latency        seconds per ring hop, [mesh dim 0, mesh dim 1]
  <collective>.base_overhead      seconds per collective call, [mesh dim 0, mesh dim 1]
  gemm_efficiency.max_efficiency  fraction of peak_flops a large matmul reaches (0, 1]
  gemm_efficiency.m_sat/n_sat/k_sat  local matmul extent (elements) at which that dim
                                  stops costing efficiency
  hbm_bandwidth                   bytes/s per device between HBM and the cores (roofline
                                  term of every local matmul and relayout copy; 0: ignored)
  hbm_capacity                    bytes of HBM per device (memory feasibility; 0: unknown)
  devices_per_chip                jax devices per chip (1; 2 on TPU7x): optional
  core_link_bandwidth             bytes/s one way between the devices of one chip (TPU7x:
                                  the die-to-die link of its two chiplets); optional, 0
                                  without one
  op_overhead                     seconds of fixed cost per local op (matmul launch, tail
                                  of a pipeline step, relayout copy)
  sources                         where each number comes from (public documents, papers,
                                  measurements), free text

where <collective> is all_gather, reduce_scatter or permute (one send/recv hop).

GEMM efficiency (a saturating ramp per dim; documented here because every profile uses it):

  efficiency(m, n, k) = max_efficiency * min(1, m/m_sat) * min(1, n/n_sat) * min(1, k/k_sat)

A matmul whose dims all reach their saturation point runs at max_efficiency; halving
one dim below it halves the throughput (a half-empty systolic array / tensor-core tile
does half the useful work). Crude, but it is what makes very thin slices unattractive,
which is what bounds the slice count S from above.

Shipped profiles (`known_profiles()`):

  tpu-v4   calibrated: the original MeshSlice authors' measurements (docs/costmodel.md)
  tpu-v5e, tpu-v5p, tpu-v6e, tpu-v7x, h100   derived from public chip numbers (not
           measured); tpu-v7x (Ironwood) per TensorCore, two devices per chip
  cpu      rough numbers for the emulated-device CPU runs; do not trust them
"""
from __future__ import annotations

import dataclasses
import difflib
import importlib.resources
import json
import math
import os
import re

from .interconnect import Topology

# The collectives a profile prices, spelled as the profile JSON keys and the
# HardwareProfile fields are (underscores; a format, so not renamed). The HLO readers
# (tpu_schedule.COLLECTIVES, meshslice.hlo.KINDS) name compiled instructions and keep the
# HLO opcodes' hyphens ("all-gather"); "permute" here is HLO's "collective-permute".
COLLECTIVES = ("all_gather", "reduce_scatter", "permute")

UNITS = {
    "peak_flops": "FLOP/s per device (a chip; one TensorCore where devices_per_chip is 2)",
    "bandwidth": "bytes/s per device, [mesh dim 0, mesh dim 1]",
    "hop_latency": "seconds per ring hop, [mesh dim 0, mesh dim 1]",
    "base_overhead": "seconds per collective call, [mesh dim 0, mesh dim 1]",
    "max_efficiency": "fraction of peak_flops, in (0, 1]",
    "m_sat/n_sat/k_sat": "elements of the local matmul dim at which efficiency saturates",
    "efficiency": "max_efficiency * min(1, m/m_sat) * min(1, n/n_sat) * min(1, k/k_sat)",
    "hbm_bandwidth": "bytes/s per device (0: no memory roofline)",
    "hbm_capacity": "bytes per device (0: unknown, memory not checked)",
    "op_overhead": "seconds per local op (matmul slice, relayout copy)",
    "accumulate_bytes": "HBM bytes per output element a matmul slice moves to add into a "
                        "float32 partial sum (8: read + write, fused into the matmul)",
    "accumulate_fused": "true: that traffic overlaps the matmul (TPU output fusion); false: "
                        "it is a separate pass after it (XLA GPU)",
    "serial_collectives": "true (default): synchronous collectives on different axes run "
                          "one after the other; false: side by side (the original model)",
    "topology": "optional: the network (torus: link_bandwidth bytes/s one way per link, "
                "efficiency of all_gather / reduce_scatter / permute; islands: island_size "
                "devices per node); per-axis bandwidth derived from it, see "
                "meshslice.costmodel.topology",
    "devices_per_chip": "optional: jax devices per chip (default 1; TPU7x: 2, one per "
                        "TensorCore); the per-device fields are then the chip's share",
    "core_link_bandwidth": "optional: bytes/s one way between the devices of one chip "
                           "(0: none)",
}

# Optional scalar fields (absent in older files): name -> default.
_OPTIONAL = {"hbm_bandwidth": 0.0, "hbm_capacity": 0.0, "op_overhead": 0.0,
             "accumulate_bytes": 8.0}


def _check_number(value, where: str, *, positive: bool, at_most: float | None = None):
  # bool is an int in Python; a profile saying `true` is a typo, not a number.
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    raise ValueError(f"field {where!r} must be a number, got {value!r}")
  if not math.isfinite(value):
    raise ValueError(f"field {where!r} must be finite, got {value!r}")
  if positive and value <= 0:
    raise ValueError(f"field {where!r} must be > 0, got {value!r}")
  if not positive and value < 0:
    raise ValueError(f"field {where!r} must be >= 0 (no negative values), got {value!r}")
  if at_most is not None and value > at_most:
    raise ValueError(f"field {where!r} must be <= {at_most}, got {value!r}")


def _check_pair(value, where: str, *, positive: bool):
  if not isinstance(value, (tuple, list)) or len(value) != 2:
    raise ValueError(f"field {where!r} must be a pair [mesh dim 0, mesh dim 1], "
                     f"got {value!r}")
  for i, v in enumerate(value):
    _check_number(v, f"{where}[{i}]", positive=positive)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class CollectiveParams:
  """Alpha-beta parameters of one collective kind, per mesh dim (0, 1).

  Example:
    >>> p = CollectiveParams(bandwidth=(1e9, 2e9), hop_latency=(1e-6, 1e-6),
    ...                      base_overhead=(1e-5, 1e-5))
    >>> p.bandwidth[1]
    2000000000.0
  """

  bandwidth: tuple[float, float]
  hop_latency: tuple[float, float]
  base_overhead: tuple[float, float]

  def __post_init__(self):
    for name in ("bandwidth", "hop_latency", "base_overhead"):
      value = getattr(self, name)
      _check_pair(value, name, positive=name == "bandwidth")
      # Normalise to a tuple of floats so equality and JSON round trips are exact.
      object.__setattr__(self, name, tuple(float(v) for v in value))


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class GemmEfficiency:
  """Fraction of peak a local matmul of shape (m, n, k) reaches (see module docstring).

  Example:
    >>> e = GemmEfficiency(max_efficiency=0.8, m_sat=256, n_sat=256, k_sat=256)
    >>> e(1024, 1024, 1024), e(128, 1024, 1024), e(128, 128, 1024)
    (0.8, 0.4, 0.2)
  """

  max_efficiency: float
  m_sat: float
  n_sat: float
  k_sat: float

  def __post_init__(self):
    _check_number(self.max_efficiency, "max_efficiency", positive=True, at_most=1.0)
    for name in ("m_sat", "n_sat", "k_sat"):
      _check_number(getattr(self, name), name, positive=True)
    for name in ("max_efficiency", "m_sat", "n_sat", "k_sat"):
      object.__setattr__(self, name, float(getattr(self, name)))

  def __call__(self, m: float, n: float, k: float) -> float:
    return (self.max_efficiency * min(1.0, m / self.m_sat) * min(1.0, n / self.n_sat)
            * min(1.0, k / self.k_sat))


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class HardwareProfile:
  """Everything the time model needs to know about one kind of chip and its mesh links.

  Attributes:
    name: short identifier, e.g. "tpu-v4".
    peak_flops: FLOP/s per device (per TensorCore on TPU7x; module docstring).
    all_gather, reduce_scatter, permute: per-mesh-dim (0, 1) bandwidths (bytes/s),
      hop latencies (s) and fixed per-call overheads (s) of each collective kind.
    gemm: the GEMM-efficiency model.
    description: where the numbers come from.
    overlap: whether communication can run beside computation on this hardware (False
      for the CPU backend, whose collectives are synchronous): without it every
      schedule's streams run one after another, so slicing only adds overheads.
    hbm_bandwidth: bytes/s per device of HBM; every local matmul takes at least its HBM
      bytes / hbm_bandwidth (0: no roofline term).
    hbm_capacity: bytes of HBM per device (0: unknown; memory feasibility not checked).
    op_overhead: fixed seconds per local op (each matmul slice, each relayout copy).
    accumulate_bytes, accumulate_fused: the HBM bytes per output element a matmul slice
      moves to add into a float32 partial sum, and whether that traffic overlaps the
      matmul (True: a fused output, as the TPU compiler does) or follows it (False: a
      separate pass, as XLA on GPU does; the figure: docs/benchmarks-log.md, "Cost-model
      checks").
    sources: where the numbers come from, one entry per fact.
    topology: the interconnect's geometry (`topology.Topology`), from which
      `topology.profile_for_mesh` derives per-mesh-axis bandwidths; None: the two
      profile dims are used as given.
    serial_collectives: synchronous collectives on different mesh axes run one after
      the other (True: the unsliced program's gathers and a pipeline's first-slice
      gathers, as the TPU compiler schedules them); False: side by side (the original
      MeshSlice model, `--assume paper`).
    devices_per_chip: jax devices per chip: 1, or 2 on TPU7x (Ironwood), where each
      TensorCore is its own device; `topology.profile_for_mesh` then places the chip's
      devices next to each other on the core axis (as `meshslice.aot.make_mesh` does)
      and shares a chip's ICI links between its devices.
    core_link_bandwidth: bytes/s one way between the devices of one chip (TPU7x: the
      die-to-die link between its two chiplets); 0 when devices_per_chip is 1.

  Example:
    >>> p = load_profile("tpu-v4")
    >>> p.peak_flops, p.all_gather.bandwidth
    (275000000000000.0, (27472000000.0, 79751000000.0))
    >>> p.collective("reduce_scatter").base_overhead[0]
    2.6e-05
  """

  name: str
  peak_flops: float
  all_gather: CollectiveParams
  reduce_scatter: CollectiveParams
  permute: CollectiveParams
  gemm: GemmEfficiency
  description: str = ""
  overlap: bool = True
  hbm_bandwidth: float = 0.0
  hbm_capacity: float = 0.0
  op_overhead: float = 0.0
  sources: tuple[str, ...] = ()
  topology: Topology | None = None
  accumulate_bytes: float = 8.0
  accumulate_fused: bool = True
  serial_collectives: bool = True
  devices_per_chip: int = 1
  core_link_bandwidth: float = 0.0

  def __post_init__(self):
    if not isinstance(self.name, str) or not self.name:
      raise ValueError(f"field 'name' must be a non-empty string, got {self.name!r}")
    if not isinstance(self.description, str):
      raise ValueError(f"field 'description' must be a string, got {self.description!r}")
    _check_number(self.peak_flops, "peak_flops", positive=True)
    object.__setattr__(self, "peak_flops", float(self.peak_flops))
    for kind in COLLECTIVES:
      if not isinstance(getattr(self, kind), CollectiveParams):
        raise ValueError(f"field {kind!r} must be a CollectiveParams")
    if not isinstance(self.gemm, GemmEfficiency):
      raise ValueError("field 'gemm' must be a GemmEfficiency")
    for key in _OPTIONAL:
      _check_number(getattr(self, key), key, positive=False)
      object.__setattr__(self, key, float(getattr(self, key)))
    if isinstance(self.sources, str) or not all(isinstance(x, str) for x in self.sources):
      raise ValueError(f"field 'sources' must be a list of strings, got {self.sources!r}")
    object.__setattr__(self, "sources", tuple(self.sources))
    for flag in ("accumulate_fused", "serial_collectives"):
      if not isinstance(getattr(self, flag), bool):
        raise ValueError(f"field {flag!r} must be true or false, got "
                         f"{getattr(self, flag)!r}")
    if self.topology is not None and not isinstance(self.topology, Topology):
      raise ValueError("field 'topology' must be a Topology or None")
    _check_devices_per_chip(self.devices_per_chip)
    _check_number(self.core_link_bandwidth, "core_link_bandwidth",
                  positive=self.devices_per_chip > 1)
    object.__setattr__(self, "core_link_bandwidth", float(self.core_link_bandwidth))

  def collective(self, kind: str) -> CollectiveParams:
    """The parameters of `kind` ("all_gather", "reduce_scatter" or "permute")."""
    if kind not in COLLECTIVES:
      raise ValueError(f"collective kind must be one of {COLLECTIVES}, got {kind!r}")
    return getattr(self, kind)

  def to_json_dict(self) -> dict:
    """The JSON form written by `save_profile` (units included, for people)."""
    return {
        "name": self.name,
        "description": self.description,
        "units": dict(UNITS),
        "peak_flops": self.peak_flops,
        "collectives": {
            kind: {"bandwidth": list(p.bandwidth), "hop_latency": list(p.hop_latency),
                   "base_overhead": list(p.base_overhead)}
            for kind in COLLECTIVES for p in (self.collective(kind),)},
        "gemm_efficiency": {"max_efficiency": self.gemm.max_efficiency,
                            "m_sat": self.gemm.m_sat, "n_sat": self.gemm.n_sat,
                            "k_sat": self.gemm.k_sat},
        "overlap": self.overlap,
        **{key: getattr(self, key) for key in _OPTIONAL},
        "accumulate_fused": self.accumulate_fused,
        "serial_collectives": self.serial_collectives,
        "sources": list(self.sources),
        **({} if self.topology is None else {"topology": self.topology.to_json_dict()}),
        # written only where they say something (files of one-device chips stay as
        # they were)
        **({} if self.devices_per_chip == 1 else {"devices_per_chip": self.devices_per_chip}),
        **({} if not self.core_link_bandwidth
           else {"core_link_bandwidth": self.core_link_bandwidth}),
    }


# Every key a profile JSON file may hold at its top level (`to_json_dict` writes all but
# "compiler_terms", the calibrated section `xla_baseline.write_terms` adds); "units" is
# free text for people.
_TOP_LEVEL = ("name", "description", "units", "peak_flops", "collectives", "gemm_efficiency",
              "overlap", *_OPTIONAL, "accumulate_fused", "serial_collectives", "sources",
              "topology", "devices_per_chip", "core_link_bandwidth", "compiler_terms")
_COLLECTIVE_KEYS = ("bandwidth", "hop_latency", "base_overhead")
_GEMM_KEYS = ("max_efficiency", "m_sat", "n_sat", "k_sat")


def check_keys(obj: dict, known, where: str) -> None:
  """An unknown key is an error naming it (a typo would otherwise be ignored silently:
  `"overlapp": false` loading with overlap=True), with the nearest known key."""
  for key in obj:
    if key in known:
      continue
    text = key if isinstance(key, str) else str(key)
    close = ([k for k in known if k.lower() == text.lower()]
             or difflib.get_close_matches(text, list(known), n=1, cutoff=0.6))
    hint = f"; did you mean {close[0]!r}?" if close else ""
    owner = f"field {where!r} has an" if where else "an"
    raise ValueError(f"{owner} unknown key {key!r}{hint} (known keys: "
                     f"{', '.join(sorted(known))})")


# Checks of the optional top-level sections other modules own, {key: check(value)}: the
# module that owns a section registers its check when it is imported (xla_baseline owns
# "compiler_terms"), so this module needs no import of it. `meshslice.costmodel` imports
# every owner, and importing any costmodel module runs that package first.
SECTION_CHECKS: dict = {}


def register_section_check(key: str, check) -> None:
  """Have `load_profile` call `check(value)` on a profile file's `key` section; `check`
  raises ValueError naming the field when the section is malformed."""
  if key not in _TOP_LEVEL:
    raise ValueError(f"{key!r} is not a profile top-level key (known: {', '.join(_TOP_LEVEL)})")
  SECTION_CHECKS[key] = check


def _check_devices_per_chip(value) -> None:
  if isinstance(value, bool) or not isinstance(value, int) or value < 1:
    raise ValueError(f"field 'devices_per_chip' must be a positive int (jax devices per "
                     f"chip: 1, or 2 on TPU7x), got {value!r}")


def _field(obj: dict, key: str, where: str):
  if not isinstance(obj, dict):
    raise ValueError(f"field {where or '<top level>'!r} must be a JSON object, got {obj!r}")
  if key not in obj:
    raise ValueError(f"missing field {(where + '.' if where else '') + key!r}")
  return obj[key]


def profile_from_json_dict(data) -> HardwareProfile:
  """Build a profile from its JSON form, naming the offending field on any problem.

  Example:
    >>> p = load_profile("cpu")
    >>> profile_from_json_dict(p.to_json_dict()) == p
    True
  """
  if not isinstance(data, dict):
    raise ValueError("must hold a JSON object of profile fields (name, peak_flops, "
                     f"collectives, gemm_efficiency, ...), got a JSON {_json_kind(data)}")
  check_keys(data, _TOP_LEVEL, "")
  name = _field(data, "name", "")
  if not isinstance(name, str) or not name:
    raise ValueError(f"field 'name' must be a non-empty string, got {name!r}")
  description = data.get("description", "")
  if not isinstance(description, str):
    raise ValueError(f"field 'description' must be a string, got {description!r}")
  peak = _field(data, "peak_flops", "")
  _check_number(peak, "peak_flops", positive=True)
  colls = _field(data, "collectives", "")
  if isinstance(colls, dict):
    check_keys(colls, COLLECTIVES, "collectives")
  params = {}
  for kind in COLLECTIVES:
    c = _field(colls, kind, "collectives")
    if isinstance(c, dict):
      check_keys(c, _COLLECTIVE_KEYS, f"collectives.{kind}")
    values = {}
    for key in ("bandwidth", "hop_latency", "base_overhead"):
      where = f"collectives.{kind}.{key}"
      values[key] = _field(c, key, f"collectives.{kind}")
      _check_pair(values[key], where, positive=key == "bandwidth")
    params[kind] = CollectiveParams(**values)
  g = _field(data, "gemm_efficiency", "")
  if isinstance(g, dict):
    check_keys(g, _GEMM_KEYS, "gemm_efficiency")
  values = {}
  for key in ("max_efficiency", "m_sat", "n_sat", "k_sat"):
    values[key] = _field(g, key, "gemm_efficiency")
    _check_number(values[key], f"gemm_efficiency.{key}", positive=True,
                  at_most=1.0 if key == "max_efficiency" else None)
  overlap = data.get("overlap", True)      # optional: older files predate it
  if not isinstance(overlap, bool):
    raise ValueError(f"field 'overlap' must be true or false, got {overlap!r}")
  extra = {}
  for key, default in _OPTIONAL.items():      # optional: older files predate them
    extra[key] = data.get(key, default)
    _check_number(extra[key], key, positive=False)
  fused = data.get("accumulate_fused", True)
  if not isinstance(fused, bool):
    raise ValueError(f"field 'accumulate_fused' must be true or false, got {fused!r}")
  serial = data.get("serial_collectives", True)
  if not isinstance(serial, bool):
    raise ValueError(f"field 'serial_collectives' must be true or false, got {serial!r}")
  sources = data.get("sources", [])
  if not isinstance(sources, list) or not all(isinstance(x, str) for x in sources):
    raise ValueError(f"field 'sources' must be a list of strings, got {sources!r}")
  devices_per_chip = data.get("devices_per_chip", 1)      # optional: TPU7x's 2
  _check_devices_per_chip(devices_per_chip)
  core_link = data.get("core_link_bandwidth", 0.0)
  # a chip of several devices needs the link between them (a pair of them may be a
  # whole mesh axis)
  _check_number(core_link, "core_link_bandwidth", positive=devices_per_chip > 1)
  topology = data.get("topology")
  if isinstance(topology, dict):
    check_keys(topology, tuple(f.name for f in dataclasses.fields(Topology)), "topology")
  for key, check in SECTION_CHECKS.items():
    if key in data:
      check(data[key])
  if topology is not None:
    try:
      topology = Topology.from_json_dict(topology)
    except TypeError as e:
      raise ValueError(f"field 'topology': {e}") from None
  return HardwareProfile(name=name, peak_flops=peak, gemm=GemmEfficiency(**values),
                         description=description, overlap=overlap, sources=tuple(sources),
                         topology=topology, accumulate_fused=fused,
                         serial_collectives=serial, devices_per_chip=devices_per_chip,
                         core_link_bandwidth=core_link, **extra, **params)


def _json_kind(value) -> str:
  """The JSON name of a decoded value's type."""
  if isinstance(value, list):
    return "list"
  if isinstance(value, str):
    return "string"
  if isinstance(value, bool):
    return "boolean"
  if isinstance(value, (int, float)):
    return "number"
  return "null" if value is None else type(value).__name__


def _builtin_dir():
  return importlib.resources.files(__package__) / "profiles"


def known_profiles() -> tuple[str, ...]:
  """Names of the profiles shipped with the package, sorted.

  Example:
    >>> "tpu-v4" in known_profiles()
    True
  """
  return tuple(sorted(p.name[:-len(".json")] for p in _builtin_dir().iterdir()
                      if p.name.endswith(".json")))


def _read(source, label: str) -> HardwareProfile:
  try:
    data = json.loads(source.read_text(encoding="utf-8"))
  except json.JSONDecodeError as e:
    raise ValueError(f"hardware profile {label}: not valid JSON ({e})") from None
  except OSError as e:
    raise ValueError(f"hardware profile {label}: cannot read it ({e})") from None
  try:
    return profile_from_json_dict(data)
  except ValueError as e:
    raise ValueError(f"hardware profile {label}: {e}") from None


def load_profile(name_or_path: str | os.PathLike | HardwareProfile) -> HardwareProfile:
  """A shipped profile by name ("tpu-v4", ...) or a profile JSON file by path.

  A string that names an existing file, ends in ".json" or contains a path separator
  is read as a path; anything else must be a shipped name. A HardwareProfile passes
  through unchanged.

  Raises:
    ValueError: unknown name (the message lists the known ones), or a file that is
      missing, not JSON, lacks a field, or has a field of the wrong type or sign (the
      message names the file and the field).

  Example:
    >>> load_profile("tpu-v4").name
    'tpu-v4'
    >>> load_profile("tpu-v9")                           # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: unknown hardware profile 'tpu-v9'; known profiles: cpu, h100, tpu-v4, ...
  """
  if isinstance(name_or_path, HardwareProfile):
    return name_or_path
  text = os.fspath(name_or_path)
  looks_like_path = (not isinstance(name_or_path, str) or text.endswith(".json")
                     or os.sep in text or (os.altsep and os.altsep in text)
                     or os.path.isfile(text))
  if looks_like_path:
    return _read(_PathSource(text), repr(text))
  known = known_profiles()
  if text not in known:
    raise ValueError(f"unknown hardware profile {text!r}; known profiles: "
                     f"{', '.join(known)} (or pass the path of a profile JSON file)")
  return _read(_builtin_dir() / f"{text}.json", repr(text))


class _PathSource:
  """A file path with the `read_text` of importlib.resources traversables."""

  __slots__ = ("path",)

  def __init__(self, path):
    self.path = path

  def read_text(self, encoding):
    with open(self.path, encoding=encoding) as f:
      return f.read()


def save_profile(profile: HardwareProfile, path: str | os.PathLike) -> None:
  """Write `profile` as JSON (with a "units" key); `load_profile(path)` reads it back equal.

  Example:
    >>> import tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "mine.json")
    >>> save_profile(load_profile("tpu-v4"), path)
    >>> load_profile(path) == load_profile("tpu-v4")
    True
  """
  text = json.dumps(profile.to_json_dict(), indent=2)
  # Keep each [dim 0, dim 1] pair on one line: the files are meant to be read and edited.
  text = re.sub(r"\[\s+([-0-9.eE+,\s]*?)\s+\]",
                lambda m: "[" + ", ".join(v.strip() for v in m.group(1).split(",")) + "]", text)
  with open(path, "w", encoding="utf-8") as f:
    f.write(text + "\n")
