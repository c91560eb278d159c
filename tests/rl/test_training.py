"""The RL loop end to end on the tiny task: config errors, a short run's outputs, and resume
after a crash continuing exactly like an uninterrupted run."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from experiments import tiny_arith
from rstar2_jax.rl.trainer import ConfigValueError, RLRun, run
from rstar2_jax.traces import read_traces

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def small_config(**rl):
    c = tiny_arith.get_config()
    c.sft.steps = 4
    c.sft.batch_size = 4
    c.sft.examples = 16
    c.data.eval_problems = 4
    c.data.train_problems = 32
    c.rl.steps = rl.pop("steps", 2)
    c.rl.batch_problems = 2
    c.rl.group_size = 2
    c.rl.oversample = 2
    c.rollout.slots = 8
    c.rollout.max_response_tokens = 120
    c.rollout.max_len = 256
    c.stages = [dict(start_step=0, max_response_tokens=120, max_turns=2, filter_solved_k=0, reset_optimizer=False)]
    c.checkpoint.every = 1
    for k, v in rl.items():
        setattr(c.rl, k, v)
    return c


def test_short_run_writes_traces_metrics_checkpoints_and_results(tmp_path):
    cfg = small_config()
    results = run(cfg, str(tmp_path))
    assert set(results) == {"before", "after"} and "accuracy" in results["after"]["sampled"]
    traces = read_traces(tmp_path / "traces")
    assert len(traces) == 2 * 2 * 4  # steps x problems x 2G rollouts, kept or not
    assert set(traces["step"]) == {0, 1}
    kept = traces[traces["kept"]]
    assert len(kept) <= 2 * 2 * 2 and (traces[~traces["kept"]]["advantage"] == 0).all()
    for _, r in traces.iterrows():  # the learner's per-token entropies, written for kept rollouts only
        assert (r["entropy"] is not None and len(r["entropy"]) == len(r["token_ids"])) == bool(r["kept"])
    lines = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
    assert [l["phase"] for l in lines].count("rl") == 2 and any(l["phase"] == "sft" for l in lines)
    for rl in (l for l in lines if l["phase"] == "rl"):  # the per-step breakdown adds up
        parts = rl["time/rollout_s"] + rl["time/reward_s"] + rl["time/learner_s"] + rl["time/sync_s"]
        assert 0 < parts <= rl["time/step_s"] + 1e-6
        assert (rl["time/learner_s"] > 0) == (rl["kept_rollouts"] > 0)  # no informative group: no update
        assert 0 < rl["engine/busy"] <= 1 and 0 < rl["engine/slot_utilization"] <= 1
        assert 0 <= rl["time/tool_wait_s"] <= rl["time/tool_s"] <= rl["time/rollout_s"]
    assert sorted(int(d) for d in os.listdir(tmp_path / "checkpoints") if d.isdigit())[-1] == 2
    assert os.listdir(tmp_path / "tensorboard")
    # the trained policy evaluates straight from the run directory
    proc = subprocess.run([sys.executable, "-m", "rstar2_jax.evaluate", f"--checkpoint={tmp_path}", "--benchmarks=aime24",
                           f"--data_dir={os.path.join(ROOT, '..', 'shared', 'data')}", "--limit=1", "--samples=1",
                           "--max_tokens=20", "--max_turns=1", "--format=tiny", f"--out={tmp_path / 'eval'}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads((tmp_path / "eval" / "results.json").read_text())["results"]["aime24"]["problems"] == 1


def _rl_lines(path):
    return [l for l in map(json.loads, open(path)) if l["phase"] == "rl"]


COMPARED = ("reward_mean", "kept_rollouts", "mean_response_tokens", "mean_tool_calls", "grad_norm", "update_norm",
            "logprob_mismatch_max")


def test_resume_after_a_crash_continues_identically(tmp_path):
    cfg = small_config(steps=3)
    cfg.eval.before_and_after = False
    run(cfg, str(tmp_path / "straight"))
    # the same run killed after step 2's checkpoint: run to 2, then start again asking for 3
    cut = small_config(steps=2)
    cut.eval.before_and_after = False
    run(cut, str(tmp_path / "resumed"))
    run(cfg, str(tmp_path / "resumed"))
    a, b = _rl_lines(tmp_path / "straight" / "metrics.jsonl"), _rl_lines(tmp_path / "resumed" / "metrics.jsonl")
    assert [l["step"] for l in b] == [0, 1, 2]
    for la, lb in zip(a, b):
        for key in COMPARED:
            if key in la:
                assert la[key] == pytest.approx(lb[key], rel=1e-6, abs=1e-7), (la["step"], key)


def test_sigkill_mid_run_then_resume(tmp_path):
    """A real SIGKILL: the restarted run picks up at the last checkpoint and finishes."""
    work = tmp_path / "killed"
    args = [sys.executable, "-m", "rstar2_jax.train", "--config=experiments/tiny_arith.py", f"--workdir={work}",
            "--config.sft.steps=2", "--config.sft.batch_size=4", "--config.sft.examples=8",
            "--config.data.eval_problems=2", "--config.eval.before_and_after=False", "--config.rl.steps=4",
            "--config.rl.batch_problems=2", "--config.rl.group_size=2", "--config.checkpoint.every=1",
            "--config.rollout.max_response_tokens=100", "--config.rollout.max_len=256", "--config.rollout.slots=8"]
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ckpt = work / "checkpoints"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not (ckpt.exists() and "2" in os.listdir(ckpt)):
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert "2" in os.listdir(ckpt)
    done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "resumed from" in done.stdout
    steps = [l["step"] for l in _rl_lines(work / "metrics.jsonl")]
    assert steps[-1] == 3 and set(steps) == {0, 1, 2, 3}


@pytest.mark.parametrize("override,message", [
    ("--config.rl.roc.mode=best", "rl.roc.mode must be paper, release or off"),
    ("--config.rl.group_size=1", "rl.group_size must be >= 2"),
    ("--config.model.dtype=float8", "model.dtype must be one of"),
    ("--config.model.attention=flash", "model.attention must be one of"),
    ("--config.rl.not_a_field=3", "not_a_field"),
])
def test_bad_config_is_rejected_with_a_clear_message(tmp_path, override, message):
    proc = subprocess.run([sys.executable, "-m", "rstar2_jax.train", "--config=experiments/tiny_arith.py",
                           f"--workdir={tmp_path}", override], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and message in proc.stderr + proc.stdout
    assert not os.path.exists(tmp_path / "checkpoints")


def test_validate_directly():
    cfg = small_config()
    cfg.rollout.max_response_tokens = 10_000
    with pytest.raises(ConfigValueError, match="max_response_tokens must be < rollout.max_len"):
        RLRun(cfg, "/tmp/never-created-rl-run")
    assert not os.path.exists("/tmp/never-created-rl-run")
    cfg = small_config()
    cfg.model.decode_attention = "pallas"  # small_config's max_len is 256: fine
    cfg.rollout.max_len = 200
    with pytest.raises(ConfigValueError, match="needs rollout.max_len to be a multiple of 128"):
        RLRun(cfg, "/tmp/never-created-rl-run")


def test_stage_filter_drops_problems_solved_k_of_k(tmp_path):
    from rstar2_jax.data.arith import Problem

    rl = RLRun(small_config(), str(tmp_path))
    rl.train_problems = [Problem(str(i), f"q{i}", "1", "1") for i in range(5)]
    batch, pos = rl._next_problems(3, skip={"4", "0"})
    assert [p.id for p in batch] == ["3", "1"] and pos == 2
    with pytest.raises(RuntimeError, match="filtered out"):
        rl._next_problems(0, skip={str(i) for i in range(5)})


def test_step_breakdown_measures_tool_wait_against_engine_work():
    from rstar2_jax.rl.trainer import step_breakdown
    from rstar2_jax.rollout.engines.jax_engine import EngineStats
    from rstar2_jax.timeline import Timeline

    t = Timeline()
    t.extend("engine", [(0.0, 4.0), (6.0, 10.0)])
    t.extend("tool", [(3.0, 7.0), (3.5, 5.0)])  # 4 s of tool wall time, 2 s of it with the engine idle
    t.add("reward", 10.0, 10.5)
    m = step_breakdown(t, rollout_s=10.0, step_s=12.0, stats_before=EngineStats(slots=4),
                       stats_after=EngineStats(decode_steps=10, busy_slot_steps=30, slots=4))
    assert m["time/tool_s"] == 4.0 and m["time/tool_wait_s"] == 2.0 and m["time/tool_overlap"] == 0.5
    assert m["engine/busy"] == 0.8 and m["engine/slot_utilization"] == 0.75 and m["time/reward_s"] == 0.5
