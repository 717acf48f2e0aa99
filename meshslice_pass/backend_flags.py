"""Which compiler flags let sliced collectives overlap the matmuls, per TPU generation,
and whether the backend a program will run on has them.

Slicing only pays when the compiler runs each slice's collective asynchronously beside
the previous slice's matmul. On TPU that takes libtpu's async collective flags, on GPU
XLA's latency-hiding scheduler (docs/tpu.md); both are read once, when the backend
starts. The report says when they are missing, and when a flag the newest libtpu calls
unsafe for the mesh's TPU generation is set.

The TPU target table lives here: `GENERATIONS` (one `Generation` row per TPU
generation: profile, torus, device kind, async flags), from which `TPU_ASYNC_FLAGS`,
`tpu_generation` and `profile_generation` read; and the named flag sets compiled with
(`FLAG_PRESETS` / `preset_flags`, the compared programs `VARIANTS` / `variant_flags`),
which meshslice.aot re-exports.

The flags per generation (`tpu_overlap_flags`; measured on libtpu 0.0.42.1 and 0.0.50.1,
docs/tpu.md "Flags per generation"):

    v5e            CONTINUATION_FUSION_FLAGS: MaxText's CF_FOR_ALL_GATHER group, async
                   collective fusion including all-gather continuation fusion (libtpu
                   fuses so on v5e by default)
    v4             SAFE_ASYNC_FLAGS: the same group with all-gather continuation fusion
                   off. libtpu 0.0.50.1 refuses continuation fusion for all-gathers on
                   v4, v5p and v6e ("not supported/recommended on platforms other than
                   TPU v5e ... incorrect results, hang, SDC"); --xla_enable_async_all_gather
                   gives all-gather-start/-done pairs instead
    v5p, v6e       SAFE_ASYNC_FLAGS + SPARSE_CORE_OFFLOAD_FLAGS: the chips' SparseCores
                   run all-gathers, reduce-scatters and all-reduces beside the
                   TensorCore's compute (call-start / call-done in the compiled program).
                   Without them libtpu keeps most collectives synchronous there; with
                   them XLA's own dense program hides most of its communication
                   (docs/benchmarks-log.md), which the planner prices (`sparse_core_offload`)
    tpu7x          TPU7X_FLAGS: SAFE_ASYNC_FLAGS, continuation fusion of all-reduces and
                   reduce-scatters off too, and SPARSE_CORE_OFFLOAD_FLAGS: what MaxText
                   sets on Ironwood (its ENABLE_SPARSECORE_OFFLOADING_FOR_RS_AG_AR, less
                   the profiler-tracing flags and the one flag libtpu 0.0.42.1 does not
                   know). On Ironwood libtpu offloads to the SparseCores *by default*
                   (0.0.42.1, tpu7x:2x2x1: every all-gather and reduce-scatter, all-reduces
                   of 32 MiB but not of 4 MiB, with no flag set), so the flags pin that
                   down rather than turn it on; only setting an offload flag to false
                   turns it off (`sparse_core_offload`)

Example:
  >>> tpu_overlap_flags("v4")[-1], tpu_overlap_flags("v5e") == CONTINUATION_FUSION_FLAGS
  ('--xla_enable_async_all_gather=true', True)
  >>> missing_overlap_flags("tpu", {"LIBTPU_INIT_ARGS": ""}, generation="v4")[:2]
  ('--xla_tpu_enable_async_collective_fusion=true',
   '--xla_tpu_enable_async_collective_fusion_fuse_all_gather=false')
  >>> unsafe_flags("v4", CONTINUATION_FUSION_FLAGS)
  ('--xla_tpu_enable_async_collective_fusion_fuse_all_gather=true',)
  >>> missing_overlap_flags("cpu", {})
  ()
"""
from __future__ import annotations

import dataclasses
import os

# MaxText's CF_FOR_ALL_GATHER group: async collective fusion, all-gathers included
# (continuation fusion), over several steps. Safe on v5e only (module docstring).
CONTINUATION_FUSION_FLAGS = (
    "--xla_tpu_enable_async_collective_fusion=true",
    "--xla_tpu_enable_async_collective_fusion_fuse_all_gather=true",
    "--xla_tpu_enable_async_collective_fusion_multiple_steps=true",
    "--xla_tpu_overlap_compute_collective_tc=true",
    "--xla_enable_async_all_gather=true")
# The same group without all-gather continuation fusion: what libtpu 0.0.50.1 accepts on
# v4, v5p and v6e (fuse_all_gather=false is spelled out, so a changed default cannot
# turn it back on). Also accepted by libtpu 0.0.42.1.
SAFE_ASYNC_FLAGS = (
    "--xla_tpu_enable_async_collective_fusion=true",
    "--xla_tpu_enable_async_collective_fusion_fuse_all_gather=false",
    "--xla_tpu_enable_async_collective_fusion_multiple_steps=true",
    "--xla_tpu_overlap_compute_collective_tc=true",
    "--xla_enable_async_all_gather=true")
# SparseCore collective offload (v5p, v6e; MaxText sets it on v6e): the collectives run
# on the SparseCores, asynchronously (bench/tpu_flags_probe.py: every all-gather and
# reduce-scatter of a sliced program becomes a call-start on v5p and v6e, both libtpus).
# Accepted everywhere, but not for v4: there it turns the all-gathers that
# --xla_enable_async_all_gather makes async (9 of 12 in the probe) synchronous again.
# v5e compiles as without.
SPARSE_CORE_OFFLOAD_FLAGS = (
    "--xla_tpu_enable_sparse_core_collective_offload_all_gather=true",
    "--xla_tpu_enable_sparse_core_collective_offload_reduce_scatter=true",
    "--xla_tpu_enable_sparse_core_collective_offload_all_reduce=true",
    "--xla_tpu_enable_sparse_core_collective_offload_2d_all_gather=true",
    "--xla_tpu_enable_sparse_core_collective_offload_nd_reduce_scatter=true")
SPARSE_CORE_GENERATIONS = ("v5p", "v6e", "tpu7x")
# Generations whose libtpu offloads collectives to the SparseCore without being asked
# (libtpu 0.0.42.1 on tpu7x:2x2x1: all-gathers, reduce-scatters and large all-reduces
# compile as call-start / call-done to the "sparsecore" thread with LIBTPU_INIT_ARGS
# empty; only `..._offload_<kind>=false` keeps a kind on the TensorCore, synchronous)
OFFLOAD_BY_DEFAULT = ("tpu7x",)
_OFFLOAD_KEY = "--xla_tpu_enable_sparse_core_collective_offload_"
# TPU7x (Ironwood): MaxText's Ironwood group (benchmarks/xla_flags_library.py,
# ENABLE_SPARSECORE_OFFLOADING_FOR_RS_AG_AR: continuation fusion of all three kinds off
# "so collectives can be offloaded individually", SparseCore offload of all three on,
# plus SC base flags) as libtpu 0.0.42.1 takes it: on top of SAFE_ASYNC_FLAGS (which
# turn all-gather fusion off), the other two kinds' fusion off and the offload flags.
# Checked one flag set per process on tpu7x:2x2x1 (2 x 4 mesh; sliced OS + LS, a psum,
# an all-to-all): libtpu 0.0.42.1 accepts every flag of MaxText's group but
# `--2a886c8_chip_config_name=megachip_tccontrol` (an unknown flag: the process
# aborts), and none of them changes the compiled program there (offload is the default).
# Left out: the `--xla_tpu_enable_*_offload_tracing` flags (profiler annotations) and the
# SC base flags (`--xla_tpu_use_tc_device_shape_on_sc=true
# --xla_sc_enable_instruction_fusion=false --xla_sc_disjoint_spmem=false
# --xla_sc_disable_megacore_partitioning=true`: accepted, no change in the probe).
TPU7X_FLAGS = SAFE_ASYNC_FLAGS + (
    "--xla_tpu_enable_async_collective_fusion_fuse_all_reduce=false",
    "--xla_tpu_enable_async_collective_fusion_fuse_reduce_scatter=false",
) + SPARSE_CORE_OFFLOAD_FLAGS
# XLA's windowed einsum (collective matmul) off: the "dense" program.
DENSE_FLAGS = ("--xla_tpu_enable_windowed_einsum_for_all_gather=false",
               "--xla_tpu_enable_windowed_einsum_for_reduce_scatter=false")
# Asynchronous all-to-all (start / done pairs beside independent compute), accepted by
# libtpu 0.0.42.1 and 0.0.50.1 on v4, v5p and v6e (and 0.0.42.1 on tpu7x, where the
# all-to-all, synchronous by default, becomes a start / done pair): what
# `reduce_scatter="all_to_all"` needs to overlap (docs/tpu.md, "Reduce-scatters as
# all-to-alls"). XLA's own programs do not change with it.
ASYNC_ALL_TO_ALL_FLAGS = ("--xla_tpu_enable_async_all_to_all=true",)
# The flag libtpu 0.0.50.1 refuses outside v5e.
_UNSAFE_OFF_V5E = "--xla_tpu_enable_async_collective_fusion_fuse_all_gather=true"

# The TPU target table: one row per generation as libtpu names it, with the project's
# profile for it, how jax names its devices, and the async collective flags to compile
# and run with there (module docstring). `TPU_ASYNC_FLAGS`, `tpu_generation` and
# `profile_generation` are read off these rows; meshslice.aot topologies and meshes too.
@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Generation:
  """A TPU generation as libtpu names it, and the project's profile for it."""

  name: str
  profile: str
  torus_dims: int           # 3: v4 / v5p / tpu7x, 2: v5e / v6e
  chip_config: str          # chip_config_name for get_topology_desc
  max_chips: int            # largest single slice
  device_kind: str
  devices_per_chip: int = 1  # 2 on tpu7x: each TensorCore is its own device
  # the async collective flags to compile and run with (`tpu_overlap_flags`)
  async_flags: tuple = dataclasses.field(default=SAFE_ASYNC_FLAGS, repr=False)
  # the `preset_flags` presets the rewrite is compiled under by default
  # (`rewrite_presets`): on v4 libtpu keeps reduce-scatters synchronous, and with async
  # all-to-all on `reduce_scatter="auto"` sends them as all-to-alls, which overlap
  # (docs/tpu.md); XLA's own programs do not change with that flag
  rewrite_presets: str = "async"


GENERATIONS = {
    "v4": Generation(name="v4", profile="tpu-v4", torus_dims=3, chip_config="megacore",
                     max_chips=4096, device_kind="TPU v4", async_flags=SAFE_ASYNC_FLAGS,
                     rewrite_presets="async,all_to_all"),
    "v5p": Generation(name="v5p", profile="tpu-v5p", torus_dims=3, chip_config="megacore",
                      max_chips=8960, device_kind="TPU v5",
                      async_flags=SAFE_ASYNC_FLAGS + SPARSE_CORE_OFFLOAD_FLAGS),
    "v5e": Generation(name="v5e", profile="tpu-v5e", torus_dims=2, chip_config="default",
                      max_chips=256, device_kind="TPU v5 lite",
                      async_flags=CONTINUATION_FUSION_FLAGS),
    "v6e": Generation(name="v6e", profile="tpu-v6e", torus_dims=2, chip_config="default",
                      max_chips=256, device_kind="TPU v6 lite",
                      async_flags=SAFE_ASYNC_FLAGS + SPARSE_CORE_OFFLOAD_FLAGS),
    # Ironwood: 9,216 chips per pod (cloud.google.com/tpu/docs/tpu7x); libtpu 0.0.42.1
    # refuses the "megacore" chip config for it, so a chip is two devices
    "tpu7x": Generation(name="tpu7x", profile="tpu-v7x", torus_dims=3, chip_config="default",
                        max_chips=9216, device_kind="TPU7x", devices_per_chip=2,
                        async_flags=TPU7X_FLAGS),
}


def _chip_name(generation: str) -> str:
  """How reports name a generation's chip: "TPU v4", ..., "TPU7x" (jax's device_kind)."""
  return "TPU7x" if generation == "tpu7x" else f"TPU {generation}"


# Async collective flags to compile and run with, per TPU generation (module docstring).
TPU_ASYNC_FLAGS = {g.name: g.async_flags for g in GENERATIONS.values()}
# A TPU of unknown generation gets the flags that are safe everywhere they were tried.
TPU_OVERLAP_FLAGS = SAFE_ASYNC_FLAGS
GPU_OVERLAP_FLAGS = ("--xla_gpu_enable_latency_hiding_scheduler=true",)
_VARIABLE = {"tpu": "LIBTPU_INIT_ARGS", "gpu": "XLA_FLAGS"}

# jax device_kind -> generation (compile-only topologies and real chips, e.g. "TPU v5" and
# "TPU v5p" for v5p; Ironwood's devices say "TPU7x", one per TensorCore)
_DEVICE_KINDS = {kind.lower(): g.name for g in GENERATIONS.values()
                 for kind in (g.device_kind, _chip_name(g.name))}
# profile name (after "tpu-") -> generation ("v7x" -> "tpu7x")
_PROFILE_GENERATIONS = {g.profile[len("tpu-"):]: g.name for g in GENERATIONS.values()}


def tpu_generation(device_kind: str) -> str | None:
  """The TPU generation ("v4", "v5p", "v5e", "v6e", "tpu7x") of a jax device_kind, or
  None.

  Example:
    >>> tpu_generation("TPU v5 lite"), tpu_generation("TPU v4"), tpu_generation("cpu")
    ('v5e', 'v4', None)
    >>> tpu_generation("TPU7x")
    'tpu7x'
  """
  return _DEVICE_KINDS.get(str(device_kind).strip().lower())


def mesh_generation(mesh) -> str | None:
  """The TPU generation of a mesh's devices (a `jax.sharding.Mesh`, or an AbstractMesh
  built from devices), or None: no mesh, not TPU, or a chip this table does not know.

  Example (a compile-only topology, `meshslice.aot`):
    >>> mesh_generation(aot.make_mesh("v5p:2x2x1", (2, 2)))       # doctest: +SKIP
    'v5p'
  """
  if mesh is None:
    return None
  try:
    device = mesh.devices.flat[0]
  except (ValueError, AttributeError):      # an AbstractMesh has no devices
    from meshslice.rewrites._jax_compat import abstract_device
    device = abstract_device(mesh)
  if getattr(device, "platform", None) != "tpu":
    return None
  return tpu_generation(getattr(device, "device_kind", ""))


def mesh_profile(mesh, default: str = "tpu-v4") -> str:
  """The shipped hardware profile of a mesh's TPU generation (`mesh_generation`), or
  `default` for a mesh that is not one (CPU, GPU, none)."""
  generation = mesh_generation(mesh)
  return GENERATIONS[generation].profile if generation else default


def rewrite_presets(generation: str | None) -> str:
  """The flag presets (`preset_flags` names) the rewrite is compiled under by default on
  a TPU generation, e.g. by `python -m meshslice aot`: the generation's async collective
  flags, and on v4 async all-to-all too (`Generation.rewrite_presets`). None or an
  unknown generation: "async".

  Example:
    >>> rewrite_presets("v4"), rewrite_presets("v5p")
    ('async,all_to_all', 'async')
  """
  row = GENERATIONS.get(generation) if generation else None
  return row.rewrite_presets if row else "async"


def tpu_overlap_flags(generation: str | None) -> tuple:
  """The async collective flags recommended for (and compiled with on) a TPU generation;
  None or an unknown generation: `TPU_OVERLAP_FLAGS` (the safe set)."""
  return TPU_ASYNC_FLAGS.get(generation, TPU_OVERLAP_FLAGS)


def unsafe_flags(generation: str | None, flags) -> tuple:
  """The flags of `flags` (a LIBTPU_INIT_ARGS string or a sequence) that the newest
  libtpu refuses on `generation` as unsafe (all-gather continuation fusion off v5e)."""
  given = flags.split() if isinstance(flags, str) else list(flags)
  if generation == "v5e" or generation is None:
    return ()
  return tuple(f for f in given if f == _UNSAFE_OFF_V5E)


def flags_in_effect(environ=None) -> str:
  """LIBTPU_INIT_ARGS of this process (what libtpu compiles with)."""
  environ = os.environ if environ is None else environ
  return environ.get(_VARIABLE["tpu"], "")


def windowed_einsum_off(flags) -> frozenset:
  """Which collectives XLA's windowed einsum is turned off for by `flags` (a
  LIBTPU_INIT_ARGS string): a subset of {"all_gather", "reduce_scatter"}.

  Example:
    >>> sorted(windowed_einsum_off(" ".join(DENSE_FLAGS)))
    ['all_gather', 'reduce_scatter']
  """
  return frozenset(kind for kind in ("all_gather", "reduce_scatter")
                   if _last_value(flags, f"--xla_tpu_enable_windowed_einsum_for_{kind}")
                   in ("false", "0"))


def _last_value(flags, key: str) -> str | None:
  """The value the last `key[=value]` of `flags` (a LIBTPU_INIT_ARGS string or a
  sequence) sets, lower-cased ("true" for a bare `key`); None when it is not given."""
  given = flags.split() if isinstance(flags, str) else list(flags)
  values = [f.split("=", 1)[1].lower() if "=" in f else "true" for f in given
            if f.split("=", 1)[0] == key]
  return values[-1] if values else None


def async_all_to_all(flags) -> bool:
  """Whether `flags` (a LIBTPU_INIT_ARGS string or a sequence) turn libtpu's async
  all-to-all on (the last `--xla_tpu_enable_async_all_to_all` given wins).

  Example:
    >>> async_all_to_all(" ".join(ASYNC_ALL_TO_ALL_FLAGS)), async_all_to_all("")
    (True, False)
  """
  return _last_value(flags, ASYNC_ALL_TO_ALL_FLAGS[0].split("=", 1)[0]) in ("true", "1")


def sparse_core_offload(flags, generation: str | None) -> frozenset:
  """The collectives `flags` (a LIBTPU_INIT_ARGS string or a sequence) offload to the
  SparseCore on `generation`: a subset of {"all_gather", "reduce_scatter",
  "all_reduce"}; empty off v5p / v6e / tpu7x, where libtpu ignores the flags. On tpu7x
  libtpu offloads by default (`OFFLOAD_BY_DEFAULT`): every kind not turned off.
  (libtpu keeps small all-reduces on the TensorCore even so: 4 MiB on tpu7x:2x2x1.)

  Example:
    >>> sorted(sparse_core_offload(SPARSE_CORE_OFFLOAD_FLAGS, "v5p"))
    ['all_gather', 'all_reduce', 'reduce_scatter']
    >>> sparse_core_offload(SPARSE_CORE_OFFLOAD_FLAGS, "v4")
    frozenset()
    >>> sorted(sparse_core_offload(
    ...     "--xla_tpu_enable_sparse_core_collective_offload_all_reduce=false", "tpu7x"))
    ['all_gather', 'reduce_scatter']
  """
  if generation in OFFLOAD_BY_DEFAULT:
    return frozenset(kind for kind in ("all_gather", "reduce_scatter", "all_reduce")
                     if _last_value(flags, _OFFLOAD_KEY + kind) not in ("false", "0"))
  return _offload_asked(flags) if generation in SPARSE_CORE_GENERATIONS else frozenset()


def _offload_asked(flags) -> frozenset:
  """The collectives `flags` ask to offload to the SparseCore, whatever the chip."""
  return frozenset(kind for kind in ("all_gather", "reduce_scatter", "all_reduce")
                   if _last_value(flags, _OFFLOAD_KEY + kind) in ("true", "1"))


def profile_generation(profile_name: str) -> str | None:
  """The TPU generation of a cost-model profile's name ("tpu-v5p", or "tpu-v5p@64x4"
  as `profile_for_mesh` derives it), or None for a profile of no TPU.

  Example:
    >>> profile_generation("tpu-v5p@64x4"), profile_generation("cpu")
    ('v5p', None)
    >>> profile_generation("tpu-v7x@2x4")
    'tpu7x'
  """
  head = str(profile_name).split("@", 1)[0]
  generation = head[len("tpu-"):] if head.startswith("tpu-") else None
  generation = _PROFILE_GENERATIONS.get(generation, generation)
  return generation if generation in TPU_ASYNC_FLAGS else None


def missing_overlap_flags(platform: str, environ=None, *, generation=None) -> tuple:
  """The overlap flags `platform` ("tpu", "gpu", "cuda", "rocm") lacks in `environ`;
  for TPU those of `generation` (`tpu_overlap_flags`). On a generation whose libtpu
  offloads collectives by default (tpu7x) a flag counts as lacking only when
  `environ` sets it to another value: left out, libtpu's default already does what it
  says (measured with libtpu 0.0.42.1)."""
  platform = "gpu" if platform in ("gpu", "cuda", "rocm") else platform
  if platform not in _VARIABLE:
    return ()
  environ = os.environ if environ is None else environ
  text = environ.get(_VARIABLE[platform], "")
  given = set(text.split())
  wanted = tpu_overlap_flags(generation) if platform == "tpu" else GPU_OVERLAP_FLAGS
  if platform == "tpu" and generation in OFFLOAD_BY_DEFAULT:
    return tuple(flag for flag in wanted if flag not in given
                 and _last_value(text, flag.split("=", 1)[0]) is not None)
  return tuple(flag for flag in wanted if flag not in given)


# TPU generations whose libtpu keeps reduce-scatters synchronous under every flag tried
# (docs/tpu.md): there the pass's all-to-all form is what overlaps them
SYNC_REDUCE_SCATTER_GENERATIONS = ("v4", "v5p", "v6e")


def overlap_note(sites, mesh, environ=None) -> tuple:
  """Report notes when sliced sites will run on a backend without its overlap flags,
  or (TPU) with a flag the newest libtpu refuses on the mesh's generation, or (TPU v4,
  v5p, v6e) when reduce-scatters could be async all-to-alls but the flag is missing."""
  from jax.sharding import Mesh
  if not isinstance(mesh, Mesh):
    return ()        # an AbstractMesh has no devices: the backend is not known here
  device = mesh.devices.flat[0]
  platform = getattr(device, "platform", "")
  generation = tpu_generation(getattr(device, "device_kind", "")) if platform == "tpu" else None
  scatter_note = _all_to_all_note(sites, generation, environ)
  if not any(s.rewritten and (s.ksplit or 1) > 1 for s in sites):
    return scatter_note
  notes = list(scatter_note)
  unsafe = unsafe_flags(generation, flags_in_effect(environ)) if platform == "tpu" else ()
  # a flag set to an unsafe value gets its own note below
  keys = {f.split("=", 1)[0] for f in unsafe}
  missing = tuple(f for f in missing_overlap_flags(platform, environ, generation=generation)
                  if f.split("=", 1)[0] not in keys)
  if missing:
    variable = _VARIABLE["gpu" if platform in ("gpu", "cuda", "rocm") else platform]
    chip = _chip_name(generation) if generation else platform.upper()
    notes.append(f"sliced collectives overlap the matmuls on {chip} only with "
                 f"{' '.join(missing)} in {variable} (set before jax starts; docs/tpu.md); "
                 "without them the slices run one after another")
  if generation == "v4" and _offload_asked(flags_in_effect(environ)):
    notes.append(f"SparseCore collective offload ({_OFFLOAD_KEY}*) is set, which makes the "
                 "async all-gathers synchronous again on TPU v4 (it has no SparseCore "
                 "for them); drop it there (docs/tpu.md)")
  if unsafe:
    notes.append(f"{' '.join(unsafe)} (all-gather continuation fusion) is set, which the "
                 f"newest libtpu refuses on {_chip_name(generation)} as unsafe (incorrect results, "
                 f"hangs); use {' '.join(tpu_overlap_flags(generation))} (docs/tpu.md)")
  return tuple(notes)


def _all_to_all_note(sites, generation, environ=None) -> tuple:
  """The note for rewritten ls / rs sites left with synchronous reduce-scatters on a TPU
  generation where the all-to-all form would overlap them, for want of the flag."""
  if generation not in SYNC_REDUCE_SCATTER_GENERATIONS:
    return ()
  flags = flags_in_effect(environ)
  if async_all_to_all(flags) or "reduce_scatter" in sparse_core_offload(flags, generation):
    return ()      # the all-to-alls overlap, or the SparseCore runs the reduce-scatters
  scattering = [s for s in sites if s.rewritten and s.dataflow in ("ls", "rs")
                and s.algorithm in ("meshslice", "collective") and not s.reduce_scatter]
  if not scattering:
    return ()
  return (f"{len(scattering)} rewritten site{'s' if len(scattering) != 1 else ''} "
          f"reduce-scatter{' their' if len(scattering) != 1 else 's its'} partial products, which "
          f"libtpu keeps synchronous on TPU {generation}; with "
          f"{ASYNC_ALL_TO_ALL_FLAGS[0]} in LIBTPU_INIT_ARGS as well (set before jax "
          f"starts) the pass sends them as async all-to-alls (reduce_scatter='auto'; "
          f"docs/tpu.md)",)


# ----------------------------------------------------------------------------- presets

# Generation-independent presets (legacy: "async" is the continuation-fusion group). For
# a topology use `preset_flags`, where "async" is the generation's own set.
FLAG_PRESETS = {"default": (), "async": CONTINUATION_FUSION_FLAGS,
                "fusion": CONTINUATION_FUSION_FLAGS, "safe_async": SAFE_ASYNC_FLAGS,
                "dense": DENSE_FLAGS, "all_to_all": ASYNC_ALL_TO_ALL_FLAGS}


def preset_flags(presets, generation: str | None) -> tuple:
  """The libtpu flags of preset names (a comma-separated string or a sequence) for a TPU
  generation: "default" (none), "async" (the generation's async collective flags,
  `tpu_overlap_flags`: no all-gather continuation fusion on v4 / v5p / v6e), "fusion"
  (the continuation-fusion group, `CONTINUATION_FUSION_FLAGS`: `aot.ASYNC_FLAGS`),
  "safe_async", "dense"
  (windowed einsum off), "all_to_all" (async all-to-all, for `reduce_scatter="all_to_all"`).

  Example:
    >>> preset_flags("dense,async", "v4")[-1]
    '--xla_enable_async_all_gather=true'
  """
  names = [p.strip() for p in presets.split(",")] if isinstance(presets, str) else presets
  out = []
  for name in (n for n in names if n):
    if name not in FLAG_PRESETS:
      raise ValueError(f"unknown libtpu flag preset {name!r}; known: {', '.join(FLAG_PRESETS)}")
    out += tpu_overlap_flags(generation) if name == "async" else FLAG_PRESETS[name]
  return tuple(out)


# The programs compared, each under its own libtpu flags (presets of `preset_flags`):
# XLA's plain and dense programs with libtpu defaults and with the async flags the
# rewrite gets, and the rewrite. The headline is the rewrite against the best of the four.
VARIANTS = {   # name: (meshslice.transform?, flag presets)
    "plain": (False, ("default",)), "dense": (False, ("dense",)),
    "plain_async": (False, ("async",)), "dense_async": (False, ("dense", "async")),
    "meshslice": (True, ("async",)),
    # the rewrite with windowed einsum off too: the sites it leaves to XLA run XLA's
    # dense program, and the planner prices them so (the rival with the same flags is
    # dense_async)
    "meshslice_dense": (True, ("dense", "async")),
}
XLA_VARIANTS = ("plain", "dense", "plain_async", "dense_async")


def variant_flags(variant: str, generation: str | None, async_presets: str = "async") -> tuple:
  """The libtpu flags `variant` (a `VARIANTS` name) compiles with on `generation`, its
  async part from `async_presets` (preset names, comma-separated)."""
  if variant not in VARIANTS:
    raise ValueError(f"variant must be one of {', '.join(VARIANTS)}, got {variant!r}")
  names = [n for p in VARIANTS[variant][1]
           for n in (async_presets.split(",") if p == "async" else [p])]
  return preset_flags(names, generation)
