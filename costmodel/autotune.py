"""The autotuner: the best (algorithm, dataflow, ksplit) of one site, and the best mesh
shape for the feed-forward GEMMs of a transformer.

Everything here is a deterministic function of its arguments: no timing, no
randomness, ties broken by a fixed order (ALGORITHMS order, then DATAFLOWS order, then
each algorithm's option variants, then the smaller ksplit). Every process of a
multi-host job gets the same answer.

The import path of the autotuner (`python -m meshslice autotune`, the docs, the
benches). The code lives in two modules, split by job; every name is re-exported here,
so `from meshslice.costmodel.autotune import X` keeps working:

  site_choice  one site: best_plan (the autotuner's rule), Choice, variants,
               valid_ksplits, EMITTABLE, NEAR_TIE; beside it the pass's own rule
               (`site_choice.choose`, re-exported by `meshslice.costing`)
  mesh_study   whole models: ModelSpec, MODELS, FF_LAYERS, LAYOUTS,
               transformer_problems, transformer_memory, mesh_shapes, evaluate_mesh,
               recommend_mesh, paper_assumptions, compare_algorithms, ...

This module holds no code of its own: the mesh study calls best_plan, so a module that
defined best_plan and re-exported the mesh study would import in a circle
(tests/test_layering.py).
"""
from .mesh_study import (ASSUMPTIONS, DATAFLOW_POLICIES, FF_LAYERS, LAYOUTS, MODELS,
                         Comparison, LayerChoice, LayerProblem, MeshRecommendation,
                         MeshResult, ModelSpec, compare_algorithms, evaluate_mesh,
                         mesh_shapes, model_spec, other_layer_time, paper_assumptions,
                         paper_layout, paper_mesh_shapes, recommend_mesh,
                         transformer_memory, transformer_problems)
from .site_choice import (EMITTABLE, NEAR_TIE, Choice, best_plan, valid_ksplits,
                          variants)

__all__ = ["ASSUMPTIONS", "DATAFLOW_POLICIES", "EMITTABLE", "FF_LAYERS", "LAYOUTS",
           "MODELS", "NEAR_TIE", "Choice", "Comparison", "LayerChoice", "LayerProblem",
           "MeshRecommendation", "MeshResult", "ModelSpec", "best_plan",
           "compare_algorithms", "evaluate_mesh", "mesh_shapes", "model_spec",
           "other_layer_time", "paper_assumptions", "paper_layout", "paper_mesh_shapes",
           "recommend_mesh", "transformer_memory", "transformer_problems",
           "valid_ksplits", "variants"]
