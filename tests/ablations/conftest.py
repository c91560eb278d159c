"""What the ablation tests share: the ablate CLI, the notebook runner, and one SFT warm start.

The three ablations (the RoC FIG4 grid, the algorithm grid, the off-policy grid) start RL from
the same seed-0 warm start (the same model, data, format and SFT settings). It is built once per
test session, by whichever pytest-xdist worker asks first, under a file lock in the directory
the workers share; the others wait for it. Each ablation is then its own module (its own xdist
group), so the grids run on both workers at once instead of one after another on one.
"""

import json
import os
import shutil
import subprocess
import sys

import nbformat
import pytest
from filelock import FileLock
from nbclient import NotebookClient

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NOTEBOOKS = os.path.join(ROOT, "notebooks")
# big enough for the SFT'd policy to solve some problems (so runs have positives, negatives and
# RoC choices), small enough for the suite: SFT on packed rows (0.55x a padded step), updates of
# at most 16 rows padded to few shapes (each new one compiles the learner's programs again: FIG4
# with one seed 145 -> 117 s); BENCHMARKS.md, "Packed SFT rows" and "Padded updates"
SMALL = ["--config.sft.steps=200", "--config.sft.token_budget=384", "--config.rl.steps=3",
         "--config.rl.batch_problems=4", "--config.data.eval_problems=16", "--config.checkpoint.every=3",
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


def ablate(workdir, *extra, config="experiments/roc_ablation.py"):
    return subprocess.run([sys.executable, "-m", "rstar2_jax.ablate", f"--config={config}", f"--workdir={workdir}",
                           *SMALL, *extra], cwd=ROOT, capture_output=True, text=True, timeout=1800)


@pytest.fixture(scope="session")
def seed0_warm_start(tmp_path_factory):
    """WORKDIR-relative `_warm_start/<key>` of the seed-0 warm start: (key, its directory)."""
    shared = tmp_path_factory.getbasetemp().parent  # the same for every xdist worker of this run
    root = shared / "ablation_warm_start"
    with FileLock(str(shared / "ablation_warm_start.lock")):
        done = root / "built.json"
        if not done.exists():
            proc = subprocess.run([sys.executable, "-c", _BUILD, str(root), *SMALL], cwd=ROOT,
                                  capture_output=True, text=True, timeout=1800)
            assert proc.returncode == 0, proc.stderr[-3000:]
            model = proc.stdout.strip().splitlines()[-1]
            done.write_text(json.dumps({"model": model}))
    model = json.loads(done.read_text())["model"]
    key_dir = os.path.dirname(model)
    return os.path.basename(key_dir), key_dir


def with_warm_start(workdir, warm_start) -> None:
    """`workdir`'s `_warm_start/` holding a copy of the shared seed-0 warm start."""
    key, key_dir = warm_start
    shutil.copytree(key_dir, workdir / "_warm_start" / key, ignore=shutil.ignore_patterns("build"))


def execute(name, env):
    nb = nbformat.read(os.path.join(NOTEBOOKS, name), as_version=4)
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the kernel inherits the environment
    try:
        NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": NOTEBOOKS}}).execute()
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    return nb


def outputs_text(nb) -> str:
    parts = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            parts.append(out.get("text", ""))
            parts.extend(str(v) for k, v in out.get("data", {}).items() if k.startswith("text/"))
    return "\n".join(parts)


def png_count(nb) -> int:
    return sum(bool(o.get("data", {}).get("image/png")) for c in nb.cells for o in c.get("outputs", []))
