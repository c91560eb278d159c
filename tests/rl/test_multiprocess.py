"""The RL loop over two JAX processes on this machine (jax.distributed, loopback coordinator,
gloo CPU collectives): each process runs half of every step's rollouts on its own engine and
sandbox, the halves are gathered, and one update runs sharded over both processes' devices.

Checked against one process that runs the same config over two devices of its own (the same
global mesh, fsdp=2): the same rollouts, metrics and weights, bit for bit; and a two-process run
resumed from its checkpoint continues exactly as an uninterrupted one.

Why two devices in one process, and why exact: the learner's step is one SPMD program over the
two devices either way, and each device runs the same compiled computation on the same rows; the
only cross-device arithmetic is sums of two operands (a + b == b + a in IEEE arithmetic), so
nothing may differ. Against a one-device process the reduction order does differ (one einsum
over the whole batch against two halves summed), and Adam amplifies such rounding for weights
whose gradient nearly cancels (g / (sqrt(v) + eps) moves by up to lr where |g| is near eps): one
weight in 8,192 ended 8.5e-6 apart on an AVX2 machine and agreed on others, so no tolerance on
that comparison is safe on every CI machine. That one- and several-device steps agree to
rounding is tested on eight devices in tests/learner/test_sharded_step.py."""

import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from rstar2_jax.core.checkpoints import RunCheckpoints, run_info
from rstar2_jax.traces import read_traces
from tests.rl.launch import launch
from tests.rl.test_training import COMPARED, close_to_rounding, rl_lines
from tests.xla_flags import xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# The barely trained policy solves nothing, so GRPO's advantages would all be zero and no update
# would move the weights. The config registers an advantage of alternating signs (in every
# process, as the config file is loaded) and keeps equal-reward groups.
CONFIG = """
import numpy as np
from experiments import tiny_arith
from rstar2_jax.algo.advantages import ADVANTAGES, AdvantageSpec

ADVANTAGES["test_alternating_signs"] = AdvantageSpec(lambda rewards, settings: np.where(
    np.arange(len(rewards)) % 2 == 0, 1.0, -1.0).astype(np.float32))


def get_config():
    c = tiny_arith.get_config()
    c.rl.advantage.name = "test_alternating_signs"
    c.rl.roc.reject_uniform_groups = False
    return c
"""


@pytest.fixture(scope="module")
def config_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("config") / "moving_tiny_arith.py"
    path.write_text(CONFIG)
    return str(path)


def train_args(config, workdir, steps: int) -> list[str]:
    return [sys.executable, "-m", "rstar2_jax.train", f"--config={config}", f"--workdir={workdir}",
            "--config.sft.steps=4", "--config.sft.batch_size=4", "--config.sft.examples=16",
            "--config.data.eval_problems=4", "--config.data.train_problems=32", "--config.eval.before_and_after=False",
            f"--config.rl.steps={steps}", "--config.rl.batch_problems=2", "--config.rl.group_size=2",
            "--config.rollout.jax.slots=8", "--config.rollout.max_len=512", "--config.checkpoint.every=1",
            "--config.checkpoint.keep=10", "--config.sandbox.local.workers=1"]


def one_process_two_devices(config, workdir, steps: int):
    env = {**os.environ, "XLA_FLAGS": xla_flags("--xla_force_host_platform_device_count=2")}
    done = subprocess.run(train_args(config, workdir, steps), cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


def two_processes(config, workdir, steps: int):
    results = launch(train_args(config, workdir, steps), workdir, n=2)
    for status, _, err in results:
        assert status == 0, err[-3000:]
    return results[0][1]


def rollouts(workdir) -> dict:
    t = read_traces(os.path.join(workdir, "traces"))
    return {(r["step"], r["problem_id"], r["sample_index"]): list(r["token_ids"]) for _, r in t.iterrows()}


def params(workdir, step: int | None = None) -> list[np.ndarray]:
    """The parameters of the run's checkpoint at `step` (None: the latest; 0: after SFT, before RL)."""
    from rstar2_jax import models
    from rstar2_jax.learner import Learner

    template = Learner(models.load_pretrained(run_info(str(workdir))["model_dir"]))
    ckpts = RunCheckpoints(os.path.join(workdir, "checkpoints"), keep=10)
    state, _ = ckpts.restore(ckpts.latest_step() if step is None else step, template.state)
    ckpts.close()
    return [np.asarray(x) for x in jax.tree.leaves(state.params)]


@pytest.mark.slow
def test_two_processes_train_as_one_and_resume_exactly(tmp_path, config_file):
    """One run over two processes, SIGKILLed mid-run and resumed, against one uninterrupted process
    over two devices: the same rollouts, metrics and weights at every step. (Both claims at once:
    an interrupted two-process run that equals the one-process run trains as one and resumes
    exactly; the first pins either failure down by step: a step before the kill that differs is
    the two processes', a later one the resume's.)"""
    one = tmp_path / "one"
    one_process_two_devices(config_file, one, steps=3)
    la = rl_lines(one)
    assert all(l["kept_rollouts"] > 0 for l in la)  # every step updated ...
    trained = {step: params(one, step) for step in (1, 2, 3)}
    assert any(not np.array_equal(x, y) for x, y in zip(params(one, step=0), trained[3]))  # ... and moved the weights

    # process 1 SIGKILLed mid-run (its step-2 checkpoint written, step 2 under way): process 0
    # stops at its next collective (not minutes later in jax.distributed's shutdown), and both
    # started again continue as the uninterrupted run, bit for bit
    resumed = tmp_path / "resumed"
    ckpts = resumed / "checkpoints"
    killed_at = {}

    journals = resumed / "inflight" / "step000002"

    def process_0_journaled(name: str) -> bool:  # a rollout of process 0's share (even indices) with tokens saved
        if not (name.endswith(".jsonl") and int(name[1:-6]) % 2 == 0):
            return False
        with open(journals / name) as f:
            return sum(1 for _ in f) >= 2  # the header, then a turn's tokens

    def step_two_begins():
        # not merely "checkpoint 2 written": process 0 may then stop at a collective before its
        # first turn is saved (one CI run did), leaving nothing of its own to resume
        if ckpts.exists() and "2" in os.listdir(ckpts) and journals.is_dir() and any(
                process_0_journaled(name) for name in os.listdir(journals)):
            killed_at["time"], killed_at["later"] = time.monotonic(), "3" in os.listdir(ckpts)
            return True
        return False

    start = time.monotonic()
    (status0, _, err0), (status1, _, _) = launch(train_args(config_file, resumed, 3), resumed, n=2,
                                                  kill_when=step_two_begins)
    assert status1 == -signal.SIGKILL and not killed_at["later"]
    assert status0 == 1 and "process 0 of 2 stopped" in err0, err0[-2000:]
    assert time.monotonic() - killed_at["time"] < 60, "process 0 should stop at its next collective"
    assert time.monotonic() - start < 400
    out = two_processes(config_file, resumed, steps=3)
    assert "resumed from" in out
    lr = rl_lines(resumed)
    assert [l["step"] for l in lr] == [0, 1, 2]  # only the primary process writes metrics
    # process 0 had saved turns of its share of step 2 when it stopped: the restart took those rollouts
    # back from the journal (rollout/journal.py) instead of generating them again
    assert lr[2]["inflight/resumed_finished"] + lr[2]["inflight/resumed_partial"] >= 1
    # the same rollouts, token for token: each process ran half of them with the same seeds
    a = rollouts(one)
    assert len(a) == 3 * 2 * 4 and rollouts(resumed) == a
    # the same update, exactly (module docstring): every step's weights, and the metrics of the
    # steps before the kill; the resumed step's metrics to float rounding (as before this run was
    # one with the uninterrupted two-process run: a journaled rollout's statistics are re-read)
    for x, y in zip(la, lr):
        for key in COMPARED:
            if key in x and x["step"] < 2:
                assert y[key] == x[key], (x["step"], key)
            elif key in x:
                assert close_to_rounding(y[key], x[key], key), (x["step"], key)
    for step in (1, 2, 3):
        for x, y in zip(trained[step], params(resumed, step)):
            np.testing.assert_array_equal(y, x)


@pytest.mark.slow
def test_two_processes_agree_on_each_cut_when_groups_are_carried(tmp_path, config_file):
    """rl.staleness.policy=carry over two processes: a group's rollouts are split between them, so
    which groups are in is decided on gathered flags; both processes cut the same groups (no
    deadlock, one batch), and every drawn group is trained exactly once."""
    work = tmp_path / "carry"
    args = train_args(config_file, work, 2) + [
        "--config.rl.max_staleness=1", "--config.rl.batch_problems=4", "--config.rl.staleness.policy=carry",
        "--config.rl.staleness.carry_fraction=0.25", "--config.rl.correction.names=('token_tis',)"]
    for status, _, err in launch(args, work, n=2):
        assert status == 0, err[-3000:]
    lines = rl_lines(work)
    assert [l["step"] for l in lines] == [0, 1]
    assert lines[0]["staleness/carried_out"] == lines[1]["staleness/carried_in"] and lines[1]["staleness/carried_out"] == 0
    traces = read_traces(work / "traces")
    assert len(traces) == 2 * 4 * 4 and len(traces.groupby(["problem_id", "sample_index"])) == 2 * 4 * 4
