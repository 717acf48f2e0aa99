"""XLA_FLAGS for the suite's CPU compiles, in-process (conftest.py) and in the
subprocesses tests start: eight emulated devices, and LLVM codegen without optimization
passes. The compiled HLO (what the tests read: collectives, fusions, schedules) is the
same text as at the default level (checked on the GPT step, plain and transformed); only
the machine code is less optimized, which the suite's tiny shapes do not notice. It about
halves XLA's CPU compile time, most of the suite's time (test_model's steps: 40 -> 18 s of
compiling each). No imports: conftest sets the flags before jax loads."""

DEVICE_COUNT = "--xla_force_host_platform_device_count=8"
FAST_CODEGEN = "--xla_backend_optimization_level=0"
CPU_XLA_FLAGS = f"{DEVICE_COUNT} {FAST_CODEGEN}"
