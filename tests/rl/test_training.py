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
from rstar2_jax.rl.run_dir import ConfigMismatchError, RunDirectory
from rstar2_jax.core.config_types import ConfigValueError
from rstar2_jax.rl.config import validate
from rstar2_jax.rl.trainer import RLRun, run
from rstar2_jax.traces import read_traces, render_trajectory, with_trajectory_columns

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
    c.rollout.jax.slots = 8
    c.rollout.max_len = 256
    c.stages = [dict(start_step=0, max_response_tokens=120, max_turns=2, filter_solved_k=0, filter_mode="offline",
                     reset_optimizer=False)]
    c.checkpoint.every = 1
    for k, v in rl.items():
        setattr(c.rl, k, v)
    return c


def tensorboard_tags(directory) -> set[str]:
    """Every tag in a TensorBoard directory's event files (TFRecord: length, CRC, event, CRC)."""
    import struct

    from tensorboardX.proto import event_pb2
    tags = set()
    for name in os.listdir(directory):
        data, pos = (directory / name).read_bytes(), 0
        while pos < len(data):
            n = struct.unpack("<Q", data[pos:pos + 8])[0]
            event = event_pb2.Event.FromString(data[pos + 12:pos + 12 + n])
            tags.update(v.tag for v in event.summary.value)
            pos += 12 + n + 4
    return tags


@pytest.mark.slow
def test_short_run_writes_traces_metrics_checkpoints_and_results(tmp_path, benchmark_dir):
    cfg = small_config(pad_width_multiple=128, pad_rows_multiple=16)  # few update shapes (rl.pad_*_multiple)
    cfg.logging.backends = ("tensorboard", "wandb", "mlflow")  # issue 39: every tracker, one run
    cfg.logging.wandb_mode = "offline"
    cfg.eval.every = 1  # issue 80: a held-out evaluation during RL (after step 1 of 2; after the last: "after")
    results = run(cfg, str(tmp_path))
    assert set(results) == {"before", "after"} and "accuracy" in results["after"]["sampled"]
    assert set(json.loads((tmp_path / "results.json").read_text())) == {"before", "after"}
    traces = read_traces(tmp_path / "traces")
    assert len(traces) == 2 * 2 * 4  # steps x problems x 2G rollouts, kept or not
    assert set(traces["step"]) == {0, 1}
    kept = traces[traces["kept"]]
    assert len(kept) <= 2 * 2 * 2 and (traces[~traces["kept"]]["advantage"] == 0).all()
    for _, r in traces.iterrows():  # the learner's per-token entropies, written for kept rollouts only
        assert (r["entropy"] is not None and len(r["entropy"]) == len(r["token_ids"])) == bool(r["kept"])
    # the trace viewer renders every row the trainer wrote (whatever its turns and tool calls hold)
    for _, r in with_trajectory_columns(traces).iterrows():
        text, html = render_trajectory(r, html=False), render_trajectory(r)
        assert text.count("--- turn ") == len(r["turns"]) and html.count("<b>turn ") == len(r["turns"])
    lines = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
    assert [l["phase"] for l in lines].count("rl") == 2 and any(l["phase"] == "sft" for l in lines)
    assert [(l["label"], l["step"]) for l in lines if l["phase"] == "eval"] == [("before_rl", 0), ("step_1", 1),
                                                                              ("after_rl", 2)]
    for rl in (l for l in lines if l["phase"] == "rl"):  # the per-step breakdown adds up
        parts = rl["time/rollout_s"] + rl["time/reward_s"] + rl["time/learner_s"] + rl["time/sync_s"]
        assert 0 < parts <= rl["time/step_s"] + 1e-6
        assert (rl["time/learner_s"] > 0) == (rl["kept_rollouts"] > 0)  # no informative group: no update
        assert 0 < rl["engine/busy"] <= 1 and 0 < rl["engine/slot_utilization"] <= 1
        assert 0 <= rl["time/tool_wait_s"] <= rl["time/tool_s"] <= rl["time/rollout_s"]
        if rl["kept_rollouts"]:  # rows padded up to the most a step keeps (2 x 2), width 128s up to max_len
            assert rl["update/rows"] == 4 and rl["update/width"] in (128, 256)
    assert sorted(int(d) for d in os.listdir(tmp_path / "checkpoints") if d.isdigit())[-1] == 2
    tags = tensorboard_tags(tmp_path / "tensorboard")
    for tag in ("accuracy", "format_failure_rate", "tool_error_ratio_correct", "sft/loss", "eval/before_rl/greedy/accuracy",
                "eval/step_1/sampled/accuracy",
                "eval/after_rl/sampled/mean_tool_calls", "results/text_summary"):
        assert tag in tags, sorted(tags)
    # W&B (offline run files) and MLflow (its SQLite store) got the same names, and the same values
    from rstar2_jax.trackers.mlflow_tracker import mlflow_name, tracking_uri
    from tests.tracker_files import mlflow_metrics, wandb_history
    history = wandb_history(tmp_path)
    logged = {k for row in history for k in row} - {"rl_step", "sft/step", "results"}
    mlflow = mlflow_metrics(tracking_uri("", str(tmp_path)), json.loads((tmp_path / "trackers.json").read_text())["mlflow"])
    assert {mlflow_name(k) for k in logged} == set(mlflow) == tags - {"results/text_summary"}
    assert [r["accuracy"] for r in history if "accuracy" in r] == [l["accuracy"] for l in lines if l["phase"] == "rl"]
    assert [v for _, v in mlflow["accuracy"]] == [l["accuracy"] for l in lines if l["phase"] == "rl"]
    # the trained policy evaluates straight from the run directory
    proc = subprocess.run([sys.executable, "-m", "rstar2_jax.evaluate", f"--checkpoint={tmp_path}", "--benchmarks=aime24",
                           f"--data_dir={benchmark_dir}", "--limit=1", "--samples=1",
                           "--max_tokens=20", "--max_turns=1", "--format=tiny", f"--out={tmp_path / 'eval'}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads((tmp_path / "eval" / "results.json").read_text())["results"]["aime24"]["problems"] == 1
    # chat drives the run's policy in the run's own prompt format
    proc = subprocess.run([sys.executable, "-m", "rstar2_jax.chat", f"--checkpoint={tmp_path}", "--prompt=What is 12*34?",
                           "--max_tokens=60", "--max_turns=2", "--temperature=0", "--isolation=basic"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("<|im_start|>system\nUse python.<|im_end|>") and "\n=== " in proc.stdout


def rl_lines(workdir) -> list[dict]:
    """The RL steps' metric records of a run directory ([] before it has any)."""
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [l for l in map(json.loads, (line for line in f if line.endswith("\n"))) if l["phase"] == "rl"]


COMPARED = ("accuracy", "kept_rollouts", "mean_response_tokens", "mean_tool_calls", "grad_norm", "update_norm",
            "logprob_mismatch_max")


def close_to_rounding(a, b, key):
    """Two runs' metric equal to float rounding. logprob_mismatch_max is itself a difference of
    float32 log-probs (each rounded to ~1 ulp of its size, 1e-6 at |logp| ~ 8), so where the learner
    meets a step's rows in another order (a resumed step takes journaled rollouts first) it moves
    by ulps: 9.5e-7 against 1.43e-6 on one CI machine. It gets that absolute tolerance; every
    other key is compared relatively."""
    abs_tol = 1e-5 if key == "logprob_mismatch_max" else 1e-7
    return a == pytest.approx(b, rel=1e-6, abs=abs_tol)


# The config.json that e37a544 (before rollout.*, sandbox.*, data.*, rl.advantage and rl.roc were
# split into each part's own section) wrote for small_config(steps=2) without evaluation: flat
# rollout.slots, sandbox.workers, data.train_path, rl.advantage="grpo", rl.roc.eps...
CONFIG_BEFORE_PART_SECTIONS = os.path.join(os.path.dirname(__file__), "fixtures", "config_written_at_e37a544.json")


@pytest.mark.slow
def test_a_run_on_a_public_set_keeping_its_template_grades_that_format_and_counts_format_failures(tmp_path):
    """DAPO-Math-17k rows (verl layout) trained with their own template kept and graded in DAPO's
    `Answer:` format: every step and evaluation counts format failures apart from wrong answers,
    each trace's extracted answer is that format's, and evaluate grades a benchmark per format."""
    from rstar2_jax.rewards import Grader
    from tests.test_problem_sets import verl_rows, write_parquet

    data = write_parquet(tmp_path / "dapo.parquet", verl_rows() * 4)
    cfg = small_config(steps=1)
    cfg.sft.steps, cfg.data.task, cfg.data.train_problems, cfg.data.eval_problems = 0, "problems", 0, 2
    cfg.data.problems.train_path = cfg.data.problems.eval_path = data
    cfg.data.problems.instructions, cfg.data.answer_format = "keep", "dapo"
    cfg.rollout.max_len = 512  # the kept template is ~340 tiny-tokenizer tokens
    work = tmp_path / "run"
    results = run(cfg, str(work))
    assert 0.0 <= results["before"]["sampled"]["format_failure_rate"] <= 1.0
    [step] = [json.loads(l) for l in open(work / "metrics.jsonl") if '"phase": "rl"' in l]
    traces = read_traces(work / "traces")
    assert step["format_failure_rate"] == pytest.approx(traces["extracted_answer"].isna().mean())
    assert all(p.startswith("Solve the following math problem step by step.") for p in traces["problem"])  # kept
    grade = Grader("dapo")
    for _, r in traces.iterrows():
        answer = r["extracted_answer"]
        answer = None if answer is None or answer != answer else answer  # pandas reads a null as NaN
        assert answer == grade(r["response_text"], r["gold"]).answer
    proc = subprocess.run([sys.executable, "-m", "rstar2_jax.evaluate", f"--checkpoint={work}", f"--benchmarks={data}",
                           "--limit=1", "--samples=2", "--max_tokens=20", "--max_turns=1",
                           f"--out={tmp_path / 'eval'}"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((tmp_path / "eval" / "results.json").read_text())
    assert report["protocol"]["answer_formats"] == {"dapo": "dapo"}  # the run's data.answer_format by default
    assert "format_failure_rate" in report["results"]["dapo"] and "format failures" in proc.stdout


@pytest.mark.slow
def test_resume_after_a_crash_continues_identically(tmp_path):
    """Also resumes a run directory whose config.json an older version wrote (flat settings that
    have moved into each part's section since): it reads as the same config, not a change."""
    cfg = small_config(steps=3)
    cfg.eval.before_and_after = False
    run(cfg, str(tmp_path / "straight"))
    # the same run killed after step 2's checkpoint: run to 2, then start again asking for 3
    cut = small_config(steps=2)
    cut.eval.before_and_after = False
    run(cut, str(tmp_path / "resumed"))
    with open(CONFIG_BEFORE_PART_SECTIONS) as f:
        old = json.load(f)
    assert old["rollout"]["slots"] == 8 and old["rl"]["advantage"] == "grpo" and "eps" in old["rl"]["roc"]
    (tmp_path / "resumed" / "config.json").write_text(json.dumps(old))
    run(cfg, str(tmp_path / "resumed"))
    history = RunDirectory(str(tmp_path / "resumed")).config_history()
    assert [(h["accepted"], sorted(h["changes"])) for h in history] == [("resumable", ["rl.steps"])]
    a, b = rl_lines(tmp_path / "straight"), rl_lines(tmp_path / "resumed")
    assert [l["step"] for l in b] == [0, 1, 2]
    for la, lb in zip(a, b):
        for key in COMPARED:
            if key in la:
                assert close_to_rounding(la[key], lb[key], key), (la["step"], key)


# Runs the trainer with orbax's commit of checkpoint 2 replaced by a SIGKILL: the process dies
# with every byte of that checkpoint written but not committed (the worst moment for a kill).
DIE_IN_CHECKPOINT_2 = """
import os, runpy, signal, sys
from orbax.checkpoint._src.path import atomicity

for cls in (atomicity.AtomicRenameTemporaryPath, atomicity.CommitFileTemporaryPath):
    def patched(real):
        async def finalize(self, *args, **kwargs):
            if os.path.basename(str(self.get_final())) == "2":
                os.kill(os.getpid(), signal.SIGKILL)
            return await real(self, *args, **kwargs)
        return finalize
    cls.finalize = patched(cls.finalize)
sys.argv = ["rstar2_jax.train", *sys.argv[1:]]
runpy.run_module("rstar2_jax.train", run_name="__main__")
"""


@pytest.mark.slow
def test_sigkill_while_a_checkpoint_is_written_then_resume(tmp_path):
    """A real SIGKILL while checkpoint 2 is being written (after step 1 trained): the half-written
    checkpoint is ignored, the restart resumes from checkpoint 1, takes step 1's rollouts back
    from the journal (rollout/journal.py: not pruned, as checkpoint 2 never committed), redoes
    its update exactly as before the kill, and finishes."""
    work = tmp_path / "killed"
    flags = ["--config=experiments/tiny_arith.py", f"--workdir={work}",
             "--config.sft.steps=2", "--config.sft.batch_size=4", "--config.sft.examples=8",
             "--config.data.eval_problems=2", "--config.eval.before_and_after=False", "--config.rl.steps=4",
             "--config.rl.batch_problems=2", "--config.rl.group_size=2", "--config.checkpoint.every=1",
             "--config.rollout.max_len=512", "--config.rollout.jax.slots=8"]
    wrapper = tmp_path / "die_in_checkpoint_2.py"
    wrapper.write_text(DIE_IN_CHECKPOINT_2)
    killed = subprocess.run([sys.executable, str(wrapper), *flags], cwd=ROOT, capture_output=True, text=True,
                            timeout=600)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert "2" not in os.listdir(work / "checkpoints") and "1" in os.listdir(work / "checkpoints")
    before = rl_lines(work)[1]  # step 1 as trained before the kill
    # the restart, interrupted with Ctrl-C (SIGINT) once step 2 is logged (issue 80): one line, no
    # traceback, exit 130
    train = [sys.executable, "-m", "rstar2_jax.train", *flags]
    proc = subprocess.Popen(train, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 600
    while proc.poll() is None and [l["step"] for l in rl_lines(work)][-1:] != [2] and time.monotonic() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 130 and "interrupted: " in err and "the same command resumes it" in err, err[-2000:]
    assert "Traceback" not in err, err[-3000:]
    done = subprocess.run(train, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "step 1" in out.split("resumed from")[1].splitlines()[0]
    lines = rl_lines(work)
    assert [l["step"] for l in lines] == [0, 1, 2, 3]  # each step once, after a kill and an interrupt
    again = lines[1]
    assert again["inflight/resumed_finished"] == 2 * 4  # every rollout of the step, from the journal
    assert again["tokens_per_s"] == 0  # nothing of it sampled now: no throughput claimed for the replay
    for key in COMPARED:
        if key in before:
            assert again[key] == before[key], key
    assert sorted(os.listdir(work / "checkpoints"))[-1] == "4" and not os.listdir(work / "inflight")


@pytest.mark.slow
def test_rerunning_a_run_directory_is_honest(tmp_path):
    """A finished run re-run reports its results (no new eval rows, no new event file); another
    config stops with the differing keys; --config_mismatch=ok and more rl.steps are recorded in
    the config history, and config.json says what the run trains with now."""
    def evals():
        return [(l["label"], l["step"]) for l in map(json.loads, open(tmp_path / "metrics.jsonl")) if l["phase"] == "eval"]

    cfg = small_config(steps=1)
    first = run(cfg, str(tmp_path))
    events = sorted(os.listdir(tmp_path / "tensorboard"))
    assert evals() == [("before_rl", 0), ("after_rl", 1)]
    assert run(cfg, str(tmp_path)) == first
    assert evals() == [("before_rl", 0), ("after_rl", 1)] and sorted(os.listdir(tmp_path / "tensorboard")) == events

    changed = small_config(steps=1, lr=1e-3)
    config_before = (tmp_path / "config.json").read_text()
    with pytest.raises(ConfigMismatchError, match=r"rl.lr: 0.0002 \(config.json\) -> 0.001 \(now\)"):
        RLRun(changed, str(tmp_path))
    assert (tmp_path / "config.json").read_text() == config_before
    assert run(changed, str(tmp_path), config_mismatch="ok") == first  # finished: nothing to train
    extended = small_config(steps=2, lr=1e-3)
    run(extended, str(tmp_path))
    history = RunDirectory(str(tmp_path)).config_history()
    assert [(h["accepted"], sorted(h["changes"])) for h in history] == [("config_mismatch=ok", ["rl.lr"]),
                                                                          ("resumable", ["rl.steps"])]
    assert json.loads((tmp_path / "config.json").read_text())["rl"] == {**json.loads(config_before)["rl"],
                                                                         "lr": 1e-3, "steps": 2}
    assert evals() == [("before_rl", 0), ("after_rl", 1), ("after_rl", 2)] and [l["step"] for l in rl_lines(tmp_path)] == [0, 1]


def test_train_cli_plan_and_config_file_errors(tmp_path):
    """--plan checks and prints the plan without touching the run directory; a missing or
    broken config file is one line naming the file (and the line); a run directory trained with
    another config is refused before anything starts."""
    data = tmp_path / "problems.jsonl"
    data.write_text('{"problem": "1+1", "answer": "2"}\n')
    work = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "rstar2_jax.train", f"--config=experiments/rstar2_agent_14b.py:,{data}",
                           f"--config.data.problems.eval_path={data}", f"--workdir={work}", "--plan",
                           "--num_processes=8", "--plan_model=qwen3_14b"],  # the recipe's hosts and shape
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "stage 2: steps 385-509: 12288 tokens, 15 turns, drop problems solved 8/8 (offline), optimizer reset" in proc.stdout
    assert "per step: 512 problems x 32 rollouts = 16384" in proc.stdout and "64 devices" in proc.stdout
    assert not work.exists()
    broken = tmp_path / "broken.py"
    broken.write_text("from rstar2_jax.rl.config import base_config\n\ndef get_config():\n    c = base_config()\n"
                      "    c.rl.nope = 1 +\n    return c\n")
    for config, message in ((str(tmp_path / "missing.py"), f"--config={tmp_path / 'missing.py'}: no such file"),
                            (str(broken), f"{broken}:5: SyntaxError")):
        proc = subprocess.run([sys.executable, "-m", "rstar2_jax.train", f"--config={config}", f"--workdir={work}"],
                              cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    # a run directory trained with another config: refused by every process before anything starts
    RunDirectory(str(work)).record_config(validate(tiny_arith.get_config()).to_dict())
    proc = subprocess.run([sys.executable, "-m", "rstar2_jax.train", "--config=experiments/tiny_arith.py",
                           f"--workdir={work}", "--config.rl.lr=0.001"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "rl.lr: 0.0002 (config.json) -> 0.001 (now)" in proc.stderr, proc.stderr
    assert sorted(os.listdir(work)) == ["config.json"]  # nothing built, no SFT run


@pytest.mark.parametrize("override,message", [
    ("--config.rl.roc.mode=best", "rl.roc.mode: unknown RoC mode 'best'; registered: off, paper, release"),
    ("--config.rl.group_size=1", "rl.group_size: must be >= 2, got 1"),
    ("--config.model.dtype=float8", "model.dtype: unknown dtype 'float8'; did you mean 'float32'? registered: bfloat16, float32"),
    ("--config.model.attention=flash", "model.attention: must be one of 'xla', 'cudnn'"),
    ("--config.rl.not_a_field=3", "--config.rl.not_a_field: no such field"),
    ("--config.rl.roc.mod=paper", "--config.rl.roc.mod: no such field; did you mean --config.rl.roc.mode?"),
    # issue 80: a missing prefix said only "'roc'"; another codebase's name got no suggestion
    ("--config.roc.mode=paper", "--config.roc.mode: no such field; did you mean --config.rl.roc.mode?"),
    ("--config.rl.learning_rate=1e-5", "--config.rl.learning_rate: no such field; did you mean --config.rl.lr?"),
    ("--config.rollout.slots=4", "--config.rollout.slots: moved; set --config.rollout.jax.slots instead"),
    ("--config.rl.advantage=mean_only", "--config.rl.advantage is a section now: set "
                                        "--config.rl.advantage.name=mean_only"),
])
def test_bad_config_is_rejected_with_a_clear_message(tmp_path, override, message):
    """One line per problem on stderr, first thing printed: no traceback, no flag dump."""
    proc = subprocess.run([sys.executable, "-m", "rstar2_jax.train", "--config=experiments/tiny_arith.py",
                           f"--workdir={tmp_path}", override], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert proc.stderr.startswith("error: ") and "Traceback" not in proc.stderr and len(proc.stderr.splitlines()) <= 4
    assert not os.path.exists(tmp_path / "checkpoints")


def test_every_unknown_override_is_reported_at_once_with_the_field_meant():
    """Issue 80: only the first unknown key was reported."""
    from rstar2_jax import cli
    argv = ["train", "--config.roc.mode=paper", "--config.rl.lr=1e-5", "--config.rl.learning_rate=1",
            "--config.rl.rocc=1", "--config.nothing_like_it_at_all=2"]
    message = cli._unknown_overrides(argv, os.path.join(ROOT, "experiments/tiny_arith.py"))
    assert message.splitlines() == [
        "--config.roc.mode: no such field; did you mean --config.rl.roc.mode?",
        "--config.rl.learning_rate: no such field; did you mean --config.rl.lr?",
        "--config.rl.rocc: no such field; did you mean --config.rl.roc?",
        "--config.nothing_like_it_at_all: no such field in the config",
    ]
    assert cli._unknown_overrides(["train", "--config.rl.lr=1"], os.path.join(ROOT, "experiments/tiny_arith.py")) is None


def test_validate_directly():
    cfg = small_config()
    cfg.stages[0]["max_response_tokens"] = 10_000
    with pytest.raises(ConfigValueError, match=r"stages\[0\].max_response_tokens: must be in \(0, rollout.max_len=256\)"):
        RLRun(cfg, "/tmp/never-created-rl-run")
    assert not os.path.exists("/tmp/never-created-rl-run")
    cfg = small_config()
    cfg.model.decode_attention = "pallas"  # small_config's max_len is 256: fine
    cfg.rollout.max_len = 200
    with pytest.raises(ConfigValueError, match="model.decode_attention: pallas needs rollout.max_len to be a multiple of 128"):
        RLRun(cfg, "/tmp/never-created-rl-run")


@pytest.mark.parametrize("field, value, message", [
    ("rl.advantage.name", "grpoo",
     "rl.advantage.name: unknown advantage 'grpoo'; did you mean 'grpo'? registered: grpo, mean_only"),
    ("rl.loss.name", "clip_hi",
     "rl.loss.name: unknown policy loss 'clip_hi'; did you mean 'clip_higher'? registered: cispo, clip_higher, gspo, reinforce"),
    ("rl.roc.mode", "best", "rl.roc.mode: unknown RoC mode 'best'; registered: off, paper, release"),
    ("format", "qwen", "format: unknown prompt format 'qwen'; registered: compact, rstar2, tiny"),
    ("data.task", "chess", "data.task: unknown task 'chess'; registered: arith, problems"),
    ("rollout.engine", "sglang", "rollout.engine: unknown engine 'sglang'; registered: jax, vllm"),
    ("rollout.vllm.scheduler", "fastest",
     "rollout.vllm.scheduler: unknown scheduler policy 'fastest'; registered: kv_aware, least_requests, round_robin"),
    ("sandbox.local.isolation", "none", "sandbox.local.isolation: must be one of 'strict', 'basic'; got 'none'"),
    ("sandbox.backend", "k8s", "sandbox.backend: unknown sandbox backend 'k8s'; registered: http, local, redis"),
])
def test_names_are_checked_against_their_registries_before_anything_runs(tmp_path, field, value, message):
    cfg = small_config()
    section, _, name = field.rpartition(".")
    setattr(cfg if not section else eval(f"cfg.{section}"), name, value)  # noqa: S307 - our own field names
    with pytest.raises(ConfigValueError) as e:
        RLRun(cfg, str(tmp_path / "run"))
    assert message in str(e.value)
    assert not os.path.exists(tmp_path / "run")  # nothing built, no SFT run


def test_all_config_errors_are_reported_at_once_and_stages_are_checked():
    cfg = small_config()
    cfg.rl.advantage.name = "x"
    cfg.stages = [dict(start_step=0, max_response_tokens=120, max_turns=0, filter_solved_k=9, filter_mode="online",
                       reset_optimizer=False),
                  dict(start_step=5, max_tokens=100)]
    with pytest.raises(ConfigValueError) as e:
        validate(cfg)
    text = str(e.value)
    assert "rl.advantage.name" in text and "stages[0].max_turns: must be >= 1" in text
    assert "stages[0].filter_solved_k: 9 exceeds the rollouts per problem" in text
    assert "stages[1].max_tokens: unknown field" in text
    assert "stages[1]: missing max_response_tokens, max_turns, filter_solved_k, filter_mode, reset_optimizer" in text


def test_prompts_that_leave_no_room_for_the_response_are_rejected_before_training(tmp_path):
    cfg = small_config()
    cfg.stages[0]["max_response_tokens"] = 250  # < max_len 256, but no prompt fits beside it
    with pytest.raises(ConfigValueError, match=r"the longest prompt \(\d+ tokens\) \+ stages\[0\]"):
        RLRun(cfg, str(tmp_path))
    assert not os.path.exists(tmp_path / "checkpoints")


def test_dead_rollout_fields_are_gone():
    """The stage decides turns and tokens: rollout.max_turns / max_response_tokens were ignored."""
    r = tiny_arith.get_config().rollout
    assert "max_turns" not in r and "max_response_tokens" not in r


def test_training_problems_are_shuffled_per_epoch_and_the_stream_resumes_exactly():
    from rstar2_jax.data.arith import Problem
    from rstar2_jax.rl.data_stream import next_problems

    problems = [Problem(str(i), f"q{i}", "1", "1") for i in range(10)]
    ids = [p.id for p in next_problems(problems, 0, 30, seed=3, skip=set())[0]]
    epochs = [ids[i:i + 10] for i in (0, 10, 20)]
    assert all(sorted(e, key=int) == [str(i) for i in range(10)] for e in epochs)  # each epoch: every problem once
    assert len({tuple(e) for e in epochs}) == 3 and epochs[0] != [str(i) for i in range(10)]  # reshuffled
    # drawn in pieces (a resumed run continues from its saved position) == drawn at once
    pieces, pos = [], 0
    for n in (4, 7, 19):
        batch, pos = next_problems(problems, pos, n, seed=3, skip=set())
        pieces += [p.id for p in batch]
    assert pieces == ids and pos == 30
    assert next_problems(problems, 0, 10, seed=4, skip=set())[0] != next_problems(problems, 0, 10, seed=3, skip=set())[0]


def test_stage_filter_skips_solved_problems():
    from rstar2_jax.data.arith import Problem
    from rstar2_jax.rl.data_stream import next_problems

    problems = [Problem(str(i), f"q{i}", "1", "1") for i in range(5)]
    batch, pos = next_problems(problems, 0, 6, seed=0, skip={"4", "0"})
    assert len(batch) == 6 and not {p.id for p in batch} & {"4", "0"} and pos == 10  # two epochs, 2 skipped in each
    with pytest.raises(RuntimeError, match="filtered out"):
        next_problems(problems, 0, 1, seed=0, skip={str(i) for i in range(5)})


def test_step_breakdown_measures_tool_wait_against_engine_work():
    from rstar2_jax.rl.step_metrics import step_breakdown
    from rstar2_jax.rollout.engines import EngineStats
    from rstar2_jax.core.timeline import Timeline

    t = Timeline()
    t.extend("engine", [(0.0, 4.0), (6.0, 10.0)])
    t.extend("tool", [(3.0, 7.0), (3.5, 5.0)])  # 4 s of tool wall time, 2 s of it with the engine idle
    t.add("reward", 10.0, 10.5)
    t.extend("request", [(0.0, 10.0)])  # the step's own turns in the engine throughout
    m = step_breakdown(t, rollout_s=10.0, step_s=12.0,
                       stats=EngineStats(decode_steps=10, busy_slot_steps=30, slots=4, own_slot_steps=12))
    assert m["time/tool_s"] == 4.0 and m["time/tool_wait_s"] == 2.0 and m["time/tool_overlap"] == 0.5
    assert m["engine/busy"] == 0.8 and m["engine/slot_utilization"] == 0.75 and m["time/reward_s"] == 0.5
    assert m["engine/own_slot_share"] == 0.4
    # asynchronous steps: engine work while none of this step's requests was in the engine is
    # another step's and does not count
    t2 = Timeline()
    t2.extend("engine", t.get("engine"))
    t2.extend("request", [(0.0, 2.0), (6.0, 7.0)])
    m = step_breakdown(t2, rollout_s=10.0, step_s=12.0, stats=None)
    assert m["engine/busy"] == pytest.approx(0.3)


def test_a_resumed_run_keeps_the_metric_rows_of_the_work_it_does_not_run_again():
    """metrics.jsonl holds every step once after any interrupt or kill (issue 80 item 5)."""
    from rstar2_jax.rl.step_metrics import rows_kept_at_resume
    rows = ([{"phase": "sft", "step": i} for i in range(3)] + [{"phase": "eval", "label": "before_rl", "step": 0}]
            + [{"phase": "rl", "step": i} for i in range(4)] + [{"phase": "eval", "label": "after_rl", "step": 4}]
            + [{"phase": "other", "step": 9}])
    # checkpoint 2 holds steps 0 and 1: step 2 on runs again
    assert rows_kept_at_resume(rows, 2, {"before"}) == rows[:4] + rows[4:6] + rows[-1:]
    # checkpoint 0 (after SFT): the before-evaluation ran but its result was not checkpointed, it
    # runs again and its row goes, with every RL step's
    assert rows_kept_at_resume(rows, 0, set()) == rows[:3] + rows[-1:]
    # finished (4 steps, the after-evaluation's result kept): nothing goes
    assert rows_kept_at_resume(rows, 4, {"before", "after"}) == rows
    # no checkpoint: SFT and everything after it run again
    assert rows_kept_at_resume(rows, None, set()) == rows[-1:]
