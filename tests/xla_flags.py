"""The suite's XLA flags: compile quickly, run a little slower.

Most of the suite's time is XLA compiling the tiny model's programs, not running them (in
tests/models/test_decoder.py, 35 of its 53 s). LLVM at optimization level 0 without its
expensive passes compiles them sooner and runs them slower. Measured side by side on this
suite's modules (BENCHMARKS.md, "Test suite: XLA's optimization level"): in-process modules
(test_decoder, test_learner) 129-132 s -> 92 s, the JaxEngine and training-run modules 148 ->
115 s; but a compute-bound SFT step 0.31 -> 0.41 s, and the ablation grid (compiled programs
mostly cached) 31 -> 38 s. So the run sets them for every worker and subprocess (tests/conftest.py)
except the compute-bound ones, which drop them (`compute_bound_env`): the ablations' SFT warm
start and their grids. What the code computes is the same program either way; only LLVM's
optimisation of it differs.
"""

import os

FAST_COMPILE = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true")


def xla_flags(*flags: str) -> str:
    """XLA_FLAGS for a process of the suite: the fast-compile flags, then `flags` (each once)."""
    return " ".join(dict.fromkeys((*FAST_COMPILE, *flags)))


def compute_bound_env(**extra: str) -> dict[str, str]:
    """This process's environment for a subprocess that mostly computes: XLA's default optimisation."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if f not in FAST_COMPILE]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    if flags:
        env["XLA_FLAGS"] = " ".join(flags)
    return {**env, **extra}
