"""Hardware profiles, time models and the autotuner (see DESIGN.md section 5)."""
