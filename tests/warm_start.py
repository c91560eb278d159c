"""One SFT'd tiny policy for the whole test session: the seed-0 warm start of the ablation grids.

The three ablations (the RoC FIG4 grid, the algorithm grid, the off-policy grid) start RL from
it, and tests that need a policy whose tool calls mostly parse and run (the remote-sandbox
comparison) load it as their model. It is built once per test session, by whichever
pytest-xdist worker asks first, under a file lock in the directory the workers share; the
others wait for it (the ablation modules come first in the collection order, so it is usually
built before anyone else asks).
"""

import json
import os
import subprocess
import sys

from filelock import FileLock

from tests.xla_flags import compute_bound_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# big enough for the SFT'd policy to solve some problems (so runs have positives, negatives and
# RoC choices), small enough for the suite: 2 RL steps per cell (the second already runs on
# updated weights), SFT on packed rows (0.55x a padded step), updates of at most 16 rows padded
# to few shapes (each new one compiles the learner's programs again: FIG4 with one seed 145 ->
# 117 s); BENCHMARKS.md, "Packed SFT rows" and "Padded updates". 8 evaluation problems: a run's
# evaluation after RL was 3.5 s of its 13 s with 16.
SMALL = ["--config.sft.steps=200", "--config.sft.token_budget=384", "--config.rl.steps=2",
         "--config.rl.batch_problems=4", "--config.data.eval_problems=8", "--config.checkpoint.every=3",
         "--config.rl.pad_width_multiple=128", "--config.rl.pad_rows_multiple=16"]

# Builds the seed-0 warm start exactly as `ablate` does for the FIG4 grid's first cell (its key
# covers the model, data, format and SFT settings, so every grid here finds it and skips SFT).
_BUILD = """
import ast, sys
from rstar2_jax import ablate
overrides = {k: ast.literal_eval(v) for k, v in (a.removeprefix("--config.").split("=", 1) for a in sys.argv[2:])}
cfg = ablate.plan("experiments/roc_ablation.py", "FIG4", 1, overrides, sys.argv[1])[0][2]
print(ablate.ensure_warm_start(cfg, sys.argv[1]))
"""


def seed0_warm_start(shared) -> tuple[str, str]:
    """(key, key directory) of the warm start under `shared` (a directory every xdist worker of
    the run sees), built there the first time any worker asks. Its model is `<key dir>/model`."""
    root = shared / "ablation_warm_start"
    with FileLock(str(shared / "ablation_warm_start.lock")):
        done = root / "built.json"
        if not done.exists():
            proc = subprocess.run([sys.executable, "-c", _BUILD, str(root), *SMALL], cwd=ROOT, env=compute_bound_env(),
                                  capture_output=True, text=True, timeout=1800)
            assert proc.returncode == 0, proc.stderr[-3000:]
            model = proc.stdout.strip().splitlines()[-1]
            done.write_text(json.dumps({"model": model}))
    model = json.loads(done.read_text())["model"]
    key_dir = os.path.dirname(model)
    return os.path.basename(key_dir), key_dir
