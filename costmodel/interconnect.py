"""The interconnect a hardware profile describes: `Topology`, data only.

It lives apart from `topology` (which derives per-mesh-axis bandwidths from it, and so
builds profiles) so that `profiles` can hold a Topology without importing the module
that imports it back.

Example:
  >>> Topology(kind="torus", physical_dims=3, link_bandwidth=4.5e10).physical_dims
  3
"""
from __future__ import annotations

import dataclasses

KINDS = ("torus", "islands")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Topology:
  """What the network looks like (see the module docstring).

  Attributes:
    kind: "torus" or "islands".
    physical_dims: 3 (v4, v5p) or 2 (v5e, v6e) for a torus.
    link_bandwidth: bytes/s one way over one link (torus).
    efficiency: fraction of the link rate each collective kind reaches, as
      (all_gather, reduce_scatter, permute) (torus).
    wrap_min_length, wrap_min_chips: when a dim has wrap-around links (torus).
    max_chips: the largest slice one network holds (more chips need several slices
      joined by the data-centre network: `dcn_shape`).
    island_size: devices per node (islands).
    dcn_bandwidth: bytes/s per chip, one way, between slices over the data-centre
      network (0: not known; a mesh over several slices is then refused).
    dcn_latency: seconds per ring step across slices.
  """

  kind: str
  physical_dims: int = 3
  link_bandwidth: float = 0.0
  efficiency: tuple[float, float, float] = (1.0, 1.0, 1.0)
  wrap_min_length: int = 4
  wrap_min_chips: int = 64
  max_chips: int = 0
  island_size: int = 8
  dcn_bandwidth: float = 0.0
  dcn_latency: float = 0.0

  def __post_init__(self):
    if self.kind not in KINDS:
      raise ValueError(f"field 'topology.kind' must be one of {KINDS}, got {self.kind!r}")
    for name in ("physical_dims", "wrap_min_length", "wrap_min_chips", "island_size"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"field 'topology.{name}' must be a positive int, got {value!r}")
    if isinstance(self.max_chips, bool) or not isinstance(self.max_chips, int) or \
        self.max_chips < 0:
      raise ValueError(f"field 'topology.max_chips' must be an int >= 0, got "
                       f"{self.max_chips!r}")
    if self.kind == "torus":
      if self.physical_dims not in (2, 3):
        raise ValueError(f"field 'topology.physical_dims' must be 2 or 3, got "
                         f"{self.physical_dims!r}")
      if (isinstance(self.link_bandwidth, bool)
          or not isinstance(self.link_bandwidth, (int, float)) or self.link_bandwidth <= 0):
        raise ValueError(f"field 'topology.link_bandwidth' must be > 0, got "
                         f"{self.link_bandwidth!r}")
    for name in ("dcn_bandwidth", "dcn_latency"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ValueError(f"field 'topology.{name}' must be a number >= 0, got {value!r}")
      object.__setattr__(self, name, float(value))
    eff = tuple(self.efficiency)
    if len(eff) != 3 or any(isinstance(e, bool) or not isinstance(e, (int, float))
                            or not 0 < e <= 2 for e in eff):
      raise ValueError(f"field 'topology.efficiency' must be 3 numbers in (0, 2] "
                       f"(all_gather, reduce_scatter, permute), got {self.efficiency!r}")
    object.__setattr__(self, "efficiency", tuple(float(e) for e in eff))
    object.__setattr__(self, "link_bandwidth", float(self.link_bandwidth))

  def to_json_dict(self) -> dict:
    return {"kind": self.kind, "physical_dims": self.physical_dims,
            "link_bandwidth": self.link_bandwidth, "efficiency": list(self.efficiency),
            "wrap_min_length": self.wrap_min_length, "wrap_min_chips": self.wrap_min_chips,
            "max_chips": self.max_chips, "island_size": self.island_size,
            "dcn_bandwidth": self.dcn_bandwidth, "dcn_latency": self.dcn_latency}

  @classmethod
  def from_json_dict(cls, data) -> "Topology":
    if not isinstance(data, dict):
      raise ValueError(f"field 'topology' must be a JSON object, got {data!r}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = set(data) - known
    if unknown:
      raise ValueError(f"field 'topology' has unknown keys {sorted(unknown)}; known: "
                       f"{sorted(known)}")
    if "kind" not in data:
      raise ValueError("missing field 'topology.kind'")
    values = dict(data)
    if "efficiency" in values and isinstance(values["efficiency"], list):
      values["efficiency"] = tuple(values["efficiency"])
    return cls(**values)
