"""The repository stands alone: nothing in it reads or links outside it, and the evaluation CLI
runs from a copy of the repository in a directory with nothing else beside it."""

import json
import os
import shutil
import subprocess
import sys

from rstar2_jax.models import tiny
from tests.benchmark_files import write_benchmarks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUTSIDE = ("../" + "shared", "shared/" + "data")  # split so this file does not match itself
SKIP_DIRS = {".git", ".venv", ".venv-vllm", "runs", "__pycache__", ".pytest_cache", ".hypothesis", ".jax_cache"}


def repo_files() -> list[str]:
    """The files a clone has: git's list in a checkout, else every file outside the build dirs."""
    if os.path.isdir(os.path.join(ROOT, ".git")):
        out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout
        return [f for f in out.splitlines() if os.path.isfile(os.path.join(ROOT, f))]
    files = []
    for d, dirs, names in os.walk(ROOT):
        dirs[:] = [x for x in dirs if x not in SKIP_DIRS and not x.endswith(".egg-info")]
        files += [os.path.relpath(os.path.join(d, n), ROOT) for n in names]
    return files


def test_no_file_points_outside_the_repository():
    offenders = []
    for rel in repo_files():
        try:
            text = open(os.path.join(ROOT, rel), encoding="utf-8").read()
        except UnicodeDecodeError:
            continue  # binary (figures)
        offenders += [f"{rel}: {pattern}" for pattern in OUTSIDE if pattern in text]
    assert not offenders, offenders


def test_evaluate_runs_from_a_copy_with_nothing_beside_it(tmp_path):
    repo = tmp_path / "clone" / "repo"
    for rel in repo_files():
        os.makedirs(repo / os.path.dirname(rel), exist_ok=True)
        shutil.copy2(os.path.join(ROOT, rel), repo / rel)
    # A decoy where the old default looked: it must never be read.
    decoy = tmp_path / "clone" / "shared" / "data"
    decoy.mkdir(parents=True)
    (decoy / "aime24.jsonl").write_text("{decoy\n")
    model = tiny.build_tiny_model(repo / "model")
    env = {k: v for k, v in os.environ.items() if k not in ("RSTAR2_DATA_DIR", "PYTHONPATH")}

    def evaluate(*args):
        return subprocess.run([sys.executable, "-m", "rstar2_jax.evaluate", f"--model={model}", "--benchmarks=aime24",
                               "--limit=1", "--samples=1", "--max_tokens=16", "--max_turns=1", "--format=tiny",
                               "--slots=2", f"--out={repo / 'eval'}", *args], cwd=repo, env=env, capture_output=True,
                              text=True, timeout=600)

    where = subprocess.run([sys.executable, "-c", "import rstar2_jax; print(rstar2_jax.__file__)"], cwd=repo, env=env,
                           capture_output=True, text=True, check=True).stdout.strip()
    assert where.startswith(str(repo)), where  # the copy's code runs, not this checkout's
    proc = evaluate()
    assert proc.returncode != 0 and "pass --data_dir DIR" in proc.stderr, proc.stderr[-2000:]
    assert "decoy" not in proc.stderr and "invalid JSON" not in proc.stderr
    data = write_benchmarks(repo / "bench")
    proc = evaluate(f"--data_dir={data}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads((repo / "eval" / "results.json").read_text())["results"]["aime24"]["problems"] == 1
