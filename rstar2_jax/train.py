"""GRPO-RoC training from an ml-collections config.

    python -m rstar2_jax.train --config=experiments/tiny_arith.py --workdir=runs/tiny_arith \
        [--config.rl.roc.mode=off] [--config.rl.steps=40]

Any field is overridable as --config.a.b=value; an unknown field or a bad value stops with a clear
message before anything runs. Re-running with the same --workdir resumes from its last checkpoint.
"""

from __future__ import annotations

from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "experiment config (a .py file with get_config())")
_WORKDIR = flags.DEFINE_string("workdir", None, "run directory: checkpoints, traces, metrics", required=True)
_COORDINATOR = flags.DEFINE_string("coordinator", None, "with --config.distributed: HOST:PORT of process 0 "
                                   "(unset: detected from the cluster environment, e.g. SLURM)")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "with --coordinator: how many processes")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "with --coordinator: this process's index")


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    from rstar2_jax.rl.trainer import ConfigValueError, format_results, run

    cfg = _CONFIG.value
    if cfg is None:
        raise app.UsageError("--config is required, e.g. --config=experiments/tiny_arith.py")
    if cfg.distributed:
        import jax
        jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU devices only; before any backend starts
        jax.distributed.initialize(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
    try:
        results = run(cfg, _WORKDIR.value)
    except ConfigValueError as e:
        raise app.UsageError(str(e)) from None
    print("\n" + format_results(results))


if __name__ == "__main__":
    app.run(main)
