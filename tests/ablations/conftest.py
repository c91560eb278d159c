"""What the ablation tests share: the ablate CLI and the notebook runner.

The three ablations (the RoC FIG4 grid, the algorithm grid, the off-policy grid) start RL from
the session's seed-0 warm start (tests/warm_start.py, the `seed0_warm_start` fixture of
tests/conftest.py). Each ablation is its own module (its own xdist group), so the grids run on
both workers at once instead of one after another on one.
"""

import os
import shutil
import subprocess
import sys

import nbformat
from nbclient import NotebookClient

from tests.warm_start import ROOT, SMALL
from tests.xla_flags import compute_bound_env

NOTEBOOKS = os.path.join(ROOT, "notebooks")


def ablate(workdir, *extra, config="experiments/roc_ablation.py"):
    return subprocess.run([sys.executable, "-m", "rstar2_jax.ablate", f"--config={config}", f"--workdir={workdir}",
                           *SMALL, *extra], cwd=ROOT, env=compute_bound_env(), capture_output=True, text=True,
                          timeout=1800)


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
