"""An ablation's runs read back: training curves, final numbers, mean and spread over seeds, plots.

Layout written by `python -m rstar2_jax.ablate`: `WORKDIR/<cell>/seed<k>/` is one training run
(metrics.jsonl, results.json, traces/) with `cell.json` naming its cell and seed. The notebook
`notebooks/roc_ablation.ipynb` and the CLI's summary both use these functions.
"""

from __future__ import annotations

import glob
import json
import os

import numpy as np
import pandas as pd

from rstar2_jax.traces import load_run

# training-curve metrics (metrics.jsonl, one row per RL step) and what a plot calls them
CURVES = {
    "accuracy": "accuracy of the step's rollouts",
    "tool_error_ratio_correct": "tool-error ratio in correct rollouts",
    "mean_response_tokens": "response tokens per rollout",
}
# what the algorithm ablation plots besides (the learner's own metrics; absent where a cell does not
# compute one: the KL to the reference only with rl.kl.coef)
ALGORITHM_CURVES = {
    **CURVES,
    "entropy_mean": "token entropy (learner)",
    "clip_low_fraction": "clipped below (fraction of tokens)",
    "clip_high_fraction": "clipped above (fraction of tokens)",
    "ppo_kl": "k1 KL(old || new) per token",
    "kl_ref_k3": "k3 KL to the reference per token",
}
# final numbers: the after-RL evaluation (results.json), sampled at the training temperature
FINALS = {
    "greedy_accuracy": ("greedy", "accuracy"),
    "sampled_accuracy": ("sampled", "accuracy"),
    "tool_error_ratio_correct": ("sampled", "tool_error_ratio_correct"),
    "mean_tool_calls": ("sampled", "mean_tool_calls"),
    "mean_response_tokens": ("sampled", "mean_response_tokens"),
}


def ablation_runs(workdir: str) -> list[dict]:
    """cell.json of every run under `workdir` (finished or not), with its `dir`."""
    out = []
    for path in sorted(glob.glob(os.path.join(workdir, "*", "seed*", "cell.json"))):
        with open(path) as f:
            out.append({**json.load(f), "dir": os.path.dirname(path)})
    return out


def load_curves(workdir: str, metrics=CURVES) -> pd.DataFrame:
    """cell, seed, step and the `metrics` (default CURVES) of every run; a metric a run does not
    log is NaN there."""
    frames = []
    for run in ablation_runs(workdir):
        if not os.path.exists(os.path.join(run["dir"], "metrics.jsonl")):
            continue
        m = load_run(run["dir"]).metrics
        if len(m):
            frames.append(m.reindex(columns=["step", *metrics]).assign(cell=run["cell"], seed=run["seed"]))
    if not frames:
        raise FileNotFoundError(f"no training metrics under {workdir}/*/seed*/")
    return pd.concat(frames, ignore_index=True)[["cell", "seed", "step", *metrics]]


def load_finals(workdir: str) -> pd.DataFrame:
    """One row per finished run (results.json written): cell, seed and the FINALS numbers."""
    rows = []
    for run in ablation_runs(workdir):
        if not os.path.exists(os.path.join(run["dir"], "results.json")):
            continue
        after = load_run(run["dir"]).results["after"]
        rows.append({"cell": run["cell"], "seed": run["seed"],
                     **{name: after[mode][key] for name, (mode, key) in FINALS.items()}})
    if not rows:
        raise FileNotFoundError(f"no finished run (results.json) under {workdir}/*/seed*/")
    return pd.DataFrame(rows)


def summarize_finals(finals: pd.DataFrame, order: list[str] | None = None) -> pd.DataFrame:
    """Per cell: number of seeds, then mean and standard deviation (ddof=1; 0 for one seed) of each
    final number, as columns `<metric>_mean`, `<metric>_std`."""
    g = finals.groupby("cell", sort=False)
    out = pd.DataFrame({"seeds": g.size()})
    for name in FINALS:
        out[f"{name}_mean"] = g[name].mean()
        out[f"{name}_std"] = g[name].std(ddof=1).fillna(0.0)
    if order is not None:
        out = out.reindex([c for c in order if c in out.index])
    return out.reset_index()


def summary_markdown(summary: pd.DataFrame) -> str:
    """The summary as a Markdown table, mean +- std over seeds (a cell of one seed: its value alone,
    with no spread to show: "± 0.0%" there read as a measured spread of zero)."""
    pct = {"greedy_accuracy", "sampled_accuracy"}
    header = ["cell", "seeds", *FINALS]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for _, r in summary.iterrows():
        seeds = int(r["seeds"])
        cells = [r["cell"], str(seeds)]
        for name in FINALS:
            m, s = r[f"{name}_mean"], r[f"{name}_std"]
            value = f"{m:.1%}" if name in pct else f"{m:.3f}"
            spread = (f" ± {s:.1%}" if name in pct else f" ± {s:.3f}") if seeds > 1 else ""
            cells.append(value + spread)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def curve_bands(curves: pd.DataFrame, metric: str) -> pd.DataFrame:
    """Per cell and step: mean, min and max of `metric` over seeds."""
    return (curves.groupby(["cell", "step"], sort=False)[metric].agg(["mean", "min", "max"]).reset_index())


def _subplots(n: int, panel_width: float, to_file: bool):
    """A figure with `n` panels in a row; headless (Agg) when it only goes to a file."""
    import matplotlib
    if to_file:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt.subplots(1, n, figsize=(panel_width * n, 3.6))


def _finish(fig, path: str | None):
    fig.tight_layout()
    if path is not None:
        import matplotlib.pyplot as plt
        fig.savefig(path, dpi=110)
        plt.close(fig)
    return fig


def plot_curves(curves: pd.DataFrame, path: str | None = None, order: list[str] | None = None, metrics=CURVES,
                labels: dict[str, str] | None = None):
    """One panel per metric (default CURVES) over RL steps: mean over seeds, band from min to max;
    `labels`: what the legend calls each cell (default its name)."""
    cells = order or list(dict.fromkeys(curves["cell"]))
    fig, axes = _subplots(len(metrics), 5, path is not None)
    from matplotlib.ticker import MaxNLocator  # after _subplots chose the backend
    for ax, (metric, label) in zip(np.atleast_1d(axes), metrics.items()):
        bands = curve_bands(curves, metric)
        for cell in cells:
            b = bands[(bands.cell == cell) & bands["mean"].notna()]
            if not len(b):
                continue
            line, = ax.plot(b.step, b["mean"], label=(labels or {}).get(cell, cell))
            ax.fill_between(b.step, b["min"], b["max"], color=line.get_color(), alpha=0.2)
        ax.set_xlabel("RL step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole (ticks at 0.25 otherwise)
        ax.set_title(label, fontsize=10)
        ax.grid(alpha=0.3)
    np.atleast_1d(axes)[0].legend(fontsize=8)
    return _finish(fig, path)


def plot_finals(summary: pd.DataFrame, path: str | None = None, labels: dict[str, str] | None = None):
    """Bar per cell for each final number, with the standard deviation over seeds (cells named by
    `labels` where given)."""
    fig, axes = _subplots(len(FINALS), 3.2, path is not None)
    x = np.arange(len(summary))
    for ax, name in zip(axes, FINALS):
        ax.bar(x, summary[f"{name}_mean"], yerr=summary[f"{name}_std"], capsize=3,
               color=[f"C{i}" for i in range(len(summary))])
        ax.set_xticks(x, [(labels or {}).get(c, c) for c in summary["cell"]], rotation=60, ha="right", fontsize=7)
        ax.set_title(name.replace("_", " "), fontsize=10)
    return _finish(fig, path)


# ---- the off-policy ablation: every figure against rl.max_staleness, one line per correction ----
# per-step metrics averaged over the last third of training, and the final numbers
STALENESS_METRICS = {
    "sampled_accuracy": "sampled accuracy after RL",
    "tool_error_ratio_correct": "tool-error ratio (correct), after RL",
    "correction/ess": "effective sample size",
    "mismatch/k1_token": "k1 KL(sampler || learner) per token",
    "mismatch/k3_token": "k3 KL(sampler || learner) per token",
    "correction/masked_fraction": "tokens dropped by the correction",
}


def staleness_table(workdir: str) -> pd.DataFrame:
    """One row per finished run of an off-policy ablation: its correction (from its config: the
    corrections' names joined, or "none"), staleness bound k, seed, the final numbers and the
    late-training means (last third of the steps) of the per-step metrics in STALENESS_METRICS."""
    rows = []
    for run in ablation_runs(workdir):
        if not os.path.exists(os.path.join(run["dir"], "results.json")):
            continue
        with open(os.path.join(run["dir"], "config.json")) as f:
            rl = json.load(f)["rl"]
        loaded = load_run(run["dir"])
        after, m = loaded.results["after"], loaded.metrics
        late = m[m["step"] >= m["step"].max() * 2 / 3]
        row = {"correction": "+".join(rl.get("correction", {}).get("names", ())) or "none",
               "k": int(rl["max_staleness"]), "seed": run["seed"],
               **{name: after[mode][key] for name, (mode, key) in FINALS.items()}}
        for metric in STALENESS_METRICS:
            if metric not in row:
                row[metric] = float(late[metric].mean()) if metric in late else np.nan
        rows.append(row)
    if not rows:
        raise FileNotFoundError(f"no finished run (results.json) under {workdir}/*/seed*/")
    return pd.DataFrame(rows)


def plot_against_staleness(table: pd.DataFrame, path: str | None = None, metrics=STALENESS_METRICS):
    """One panel per metric: its mean over seeds (error bar: std) against k, a line per correction
    (a correction run at some k only is drawn where it ran)."""
    fig, axes = _subplots(len(metrics), 3.4, path is not None)
    for ax, (metric, label) in zip(np.atleast_1d(axes), metrics.items()):
        for i, (correction, rows) in enumerate(table.groupby("correction", sort=False)):
            g = rows.groupby("k")[metric].agg(["mean", "std"]).reset_index()
            ax.errorbar(g["k"], g["mean"], yerr=g["std"].fillna(0.0), marker="o", capsize=3, label=correction,
                        color=f"C{i}")
        ax.set_xlabel("rl.max_staleness")
        ax.set_xticks(sorted(table["k"].unique()))
        ax.set_title(label, fontsize=10)
    np.atleast_1d(axes)[0].legend(fontsize=8)
    return _finish(fig, path)
