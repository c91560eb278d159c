"""Run an ablation grid (every cell x every seed, one after the other) and summarise it.

    python -m rstar2_jax.ablate --config=experiments/roc_ablation.py --seeds=3 --workdir=runs/roc_ablation
    python -m rstar2_jax.ablate --config=experiments/roc_ablation.py --grid=FIG4 --seeds=3 \
        --workdir=runs/fig4 [--config.rl.steps=20]

The config file has `get_config(arg)` and a list of cells (`--grid`, default GRID); a cell is a
tuple whose comma-joined values are the `arg` (e.g. ("paper", 4, 2, 0.001) -> "paper,4,2,0.001").
`--config.X=V` overrides apply to every cell. Runs go to WORKDIR/<run_name>/seed<k>/.

Resumable: a finished run (results.json) is skipped, an unfinished one resumes from its last
checkpoint. Runs of one seed whose model, data and SFT settings agree share one SFT warm start
(WORKDIR/_warm_start/<key>/, an HF directory), so the grid pays for SFT once per seed, or once
in all with `--warm_start_seed=K` (every seed's RL from seed K's warm start: the seeds then vary
RL alone, as RL ablations from one SFT checkpoint do); runs that evaluate the same weights the
same way share one before-RL evaluation (WORKDIR/_before_rl/).
Writes WORKDIR/summary.csv, summary.md, runs.csv, curves.png and finals.png.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import time

from absl import app, flags, logging
from ml_collections import config_flags

from rstar2_jax import cli

_CONFIG = config_flags.DEFINE_config_file("config", None, "ablation config: get_config(arg) and a list of cells")
_GRID = flags.DEFINE_string("grid", "GRID", "name of the list of cells in the config file")
_SEEDS = flags.DEFINE_integer("seeds", 3, "seeds per cell (0 .. seeds-1)")
_WARM_START_SEED = flags.DEFINE_integer(
    "warm_start_seed", None, "every seed's RL starts from this seed's SFT warm start (one SFT for the grid, "
    "so the seeds vary RL alone); default: each seed from its own", lower_bound=0)
_WORKDIR = flags.DEFINE_string("workdir", None, "ablation directory", required=True)
_SUMMARY_ONLY = flags.DEFINE_bool("summary_only", False, "only write the summary of the runs already finished")


def cell_arg(cell) -> str:
    return ",".join(str(v) for v in cell)


def load_config_module(config_file: str):
    spec = importlib.util.spec_from_file_location("ablation_config", config_file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def warm_start_key(cfg) -> str:
    """Runs with equal keys start RL from the same SFT'd weights. LoRA cells share the full
    fine-tuned warm start (their fresh adapters start at zero on it): model.lora is not in it."""
    return config_hash(cfg, ("seed", "model", "data", "format", "sft"))


def warm_start_config(cfg, warm_start_seed: int | None):
    """The config whose SFT warm start `cfg`'s RL starts from: its own, or (warm_start_seed set)
    the same cell's at that seed, so every seed of a grid shares one SFT."""
    if warm_start_seed is None:
        return cfg
    shared = cfg.copy_and_resolve_references()
    shared.seed = warm_start_seed
    return shared


def without_adapters(cfg):
    """`cfg` with model.lora off: what the warm start trains, and what a fresh adapter computes."""
    plain = cfg.copy_and_resolve_references()
    if "lora" in plain.model:
        plain.model.lora.rank = 0
    return plain


def config_hash(cfg, keys) -> str:
    """A short hash of the config's sections `keys` (model.lora left out: fresh adapters change
    neither the warm start nor the policy before RL): equal hashes, equal settings there."""
    parts = {k: cfg[k].to_dict() if hasattr(cfg[k], "to_dict") else cfg[k] for k in keys}
    if "model" in parts:
        parts["model"].pop("lora", None)
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:12]


# What a before-RL evaluation does not read: cells whose configs differ only here share one.
NOT_EVALUATED = ("rl", "run_name", "checkpoint", "logging")


def evaluation_key(cfg) -> str:
    """Runs with equal keys evaluate the same weights the same way before RL (the same results)."""
    return config_hash(cfg, [k for k in cfg.keys() if k not in NOT_EVALUATED])


def shared_before(cfg, workdir: str) -> str:
    """Where the before-RL evaluation of this config's cells is kept (made by the first that ran)."""
    return os.path.join(workdir, "_before_rl", evaluation_key(cfg) + ".json")


def ensure_warm_start(cfg, workdir: str) -> str:
    """The HF directory of this config's SFT'd model, trained the first time it is asked for."""
    from rstar2_jax import models
    from rstar2_jax.rl.trainer import RLRun

    root = os.path.join(workdir, "_warm_start", warm_start_key(cfg))
    final = os.path.join(root, "model")
    if os.path.exists(os.path.join(final, "config.json")):
        return final
    run = RLRun(without_adapters(cfg), os.path.join(root, "build"), config_mismatch="ok")  # SFT only: any cell of
    # the key may build it
    params = run.sft()
    tmp = final + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    models.save_pretrained(run.model_with(params), tmp, tokenizer_dir=run.model_dir)
    os.replace(tmp, final)  # a crash mid-write leaves no half model
    return final


def plan(config_file: str, grid: str, seeds: int, overrides: dict, workdir: str):
    """(arg, seed, config, run_dir) of every run, in order."""
    module = load_config_module(config_file)
    cells = getattr(module, grid, None)
    if not isinstance(cells, (list, tuple)) or not cells:
        raise app.UsageError(f"{config_file} has no non-empty list {grid!r} of cells")
    out = []
    for arg in map(cell_arg, cells):
        for seed in range(seeds):
            cfg = module.get_config(arg)
            cfg.update_from_flattened_dict(overrides)
            cfg.seed = seed
            out.append((arg, seed, cfg, os.path.join(workdir, cfg.run_name, f"seed{seed}")))
    return out


def write_summary(workdir: str, order: list[str], curves: dict[str, str] | None = None, label=None) -> str:
    """The summary files; `curves`: the metrics curves.png plots (default ablation.CURVES; a
    config file may name its own as CURVES); `label`: a cell's name as the plots show it (a
    config file's `cell_label(run_name)`; default: the name itself)."""
    from rstar2_jax.reports import ablation

    finals = ablation.load_finals(workdir)
    finals.to_csv(os.path.join(workdir, "runs.csv"), index=False)
    summary = ablation.summarize_finals(finals, order)
    summary.to_csv(os.path.join(workdir, "summary.csv"), index=False)
    table = ablation.summary_markdown(summary)
    with open(os.path.join(workdir, "summary.md"), "w") as f:
        f.write(table + "\n")
    metrics = curves or ablation.CURVES
    labels = {cell: label(cell) for cell in order} if label else None
    ablation.plot_curves(ablation.load_curves(workdir, metrics), os.path.join(workdir, "curves.png"), order, metrics,
                         labels=labels)
    ablation.plot_finals(summary, os.path.join(workdir, "finals.png"), labels=labels)
    return table


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    from rstar2_jax.rl.config import validate
    from rstar2_jax.rl.trainer import run

    if _CONFIG.value is None:
        raise app.UsageError("--config is required, e.g. --config=experiments/roc_ablation.py")
    config_file = config_flags.get_config_filename(flags.FLAGS["config"])
    overrides = config_flags.get_override_values(flags.FLAGS["config"])
    workdir = os.path.abspath(_WORKDIR.value)
    runs = plan(config_file, _GRID.value, _SEEDS.value, overrides, workdir)
    for _, _, cfg, _ in runs:  # every cell checked before the first one runs
        validate(cfg)
    order = list(dict.fromkeys(cfg.run_name for _, _, cfg, _ in runs))
    if not _SUMMARY_ONLY.value:
        took = []  # seconds of each cell run here (finished ones skipped): the grid's ETA
        for i, (arg, seed, cfg, run_dir) in enumerate(runs, 1):
            head = f"[{i}/{len(runs)}] {cfg.run_name} seed {seed}"
            if os.path.exists(os.path.join(run_dir, "results.json")):
                print(f"{head}: finished, skipped", flush=True)
                continue
            print(f"{head}: {run_dir}" + (f" (grid ETA {grid_eta(took, len(runs) - i + 1)})" if took else ""),
                  flush=True)
            started = time.monotonic()
            if cfg.sft.steps > 0 and not cfg.model.path:
                cfg.model.path = ensure_warm_start(warm_start_config(cfg, _WARM_START_SEED.value), workdir)
                cfg.sft.steps = 0
            os.makedirs(run_dir, exist_ok=True)
            with open(os.path.join(run_dir, "cell.json"), "w") as f:
                json.dump({"cell": cfg.run_name, "arg": arg, "seed": seed}, f)
            before_file = shared_before(cfg, workdir)
            before = json.load(open(before_file)) if os.path.exists(before_file) else None
            results = run(cfg, run_dir, before=before)
            took.append(time.monotonic() - started)
            if before is None and "before" in results:
                os.makedirs(os.path.dirname(before_file), exist_ok=True)
                with open(before_file + ".tmp", "w") as f:
                    json.dump(results["before"], f)
                os.replace(before_file + ".tmp", before_file)
    module = load_config_module(config_file)
    print("\n" + write_summary(workdir, order, getattr(module, "CURVES", None), getattr(module, "cell_label", None)))
    print(f"\nwrote {workdir}/summary.csv, summary.md, runs.csv, curves.png, finals.png\n"
          f"next: RSTAR2_RUN={workdir} make notebook (the ablation's notebook reads the grid); more seeds: the same "
          "command with a higher --seeds runs only the new cells")


def grid_eta(took: list[float], left: int) -> str:
    """`left` cells at the mean time of those run so far, as a duration and a clock time."""
    seconds = sum(took) / len(took) * left
    done_at = time.strftime("%H:%M", time.localtime(time.time() + seconds))
    return f"{int(seconds // 3600)}h{int(seconds % 3600 // 60):02d}m for {left} cell(s), about {done_at}"


if __name__ == "__main__":
    from rstar2_jax.rl.config import RunConfig
    from rstar2_jax.rl.run_dir import ConfigMismatchError
    cli.run(main, config_flag=_CONFIG, config_type=RunConfig, expected=(ConfigMismatchError,))
