"""One RL step with a toy part of every kind, each registered by one import of a module that
lives outside the repository (tests/rl/test_parts.py writes it): an engine, a sandbox backend, a
task, an advantage estimator, a RoC mode, a policy loss and an off-policy correction. Two toys have
settings of their own, set here as a built-in part's are. Prints the calls (and settings) each
toy saw, as JSON, on its last line.

    python -m tests.rl.parts_main MODULE_DIR WORKDIR
"""

import importlib
import json
import sys


def main(module_dir: str, workdir: str):
    sys.path.insert(0, module_dir)
    toys = importlib.import_module("toy_parts")  # the one import
    from rstar2_jax.rl.trainer import run
    from tests.rl.test_training import small_config

    cfg = small_config(steps=1, max_staleness=1)  # off-policy: the correction has a sampler to correct
    cfg.rollout.engine = "toy_engine"
    cfg.sandbox.backend = "toy_sandbox"
    cfg.data.task = "toy_task"
    cfg.rl.advantage.name = "toy_advantage"
    cfg.rl.roc.mode = "toy_roc"
    cfg.rl.loss.name = "toy_loss"
    cfg.rl.correction.names = ("toy_correction",)
    cfg.rl.loss.toy_loss.scale = 3.0        # a late part's own settings: in the config like any part's
    cfg.sandbox.toy_sandbox.workers = 2
    cfg.rl.roc.reject_uniform_groups = False  # the step trains whatever the rewards
    cfg.eval.before_and_after = False
    run(cfg, workdir)
    print(json.dumps(toys.CALLS))


if __name__ == "__main__":
    main(*sys.argv[1:3])
