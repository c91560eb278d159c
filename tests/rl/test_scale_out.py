"""The paper's recipe as one system on this machine, launched as one SLURM job (issue 39):
experiments/rstar2_agent_14b.py's structure (three stages, the offline pre-filter before the last
with an optimizer reset) shrunk to the tiny CPU model, written and submitted by
`python -m rstar2_jax.launch slurm` to a one-node SLURM cluster the test starts (slurmctld,
slurmd, munged): Redis, two sandbox workers, a vLLM CPU server with its weight fetcher, and two
trainer processes that find each other through SLURM, with asynchronous rollouts
(max_staleness=1) and weight syncs that land behind the trainers (sync_wait=export: process 0
lands each and publishes the verdict, process 1 takes the version on from it). Every service
answers only the job (issue 48, item 4): while it runs, a client without the job's secret is
refused by Redis, the vLLM server, its weight fetcher and the trainer's weight export, one with
it (read from a job process's environment, as only its owner can) is served, and the secret is
on no command line nor in the script or `scontrol show job`.
The job is scancel-led mid-run and its script resubmitted: the run finishes from its checkpoint."""

import json
import os
import re
import subprocess
import sys
import time

import pytest
import redis

from rstar2_jax.rl.prefilter import read_results
from rstar2_jax.traces import read_traces
from rstar2_jax.rollout.engines.vllm_engine.server import free_port
from tests.rl.launch import ROOT
from tests.rl.test_training import rl_lines
from tests.rollout.test_weight_pull import http_status
from tests.slurm_cluster import SlurmCluster

VLLM_PYTHON = os.path.join(ROOT, ".venv-vllm", "bin", "python")

# Shrunk sizes, the recipe's structure. The barely trained policy solves nothing, so an advantage
# of alternating signs (registered in every process as the file loads) makes every step update,
# which is what lets rollouts lag the learner.
CONFIG = """
import numpy as np
from experiments import rstar2_agent_14b
from rstar2_jax.algo.advantages import ADVANTAGES, AdvantageSpec

ADVANTAGES["test_alternating_signs"] = AdvantageSpec(lambda rewards, settings: np.where(
    np.arange(len(rewards)) % 2 == 0, 1.0, -1.0).astype(np.float32))


def get_config():
    c = rstar2_agent_14b.get_config()
    c.model.path, c.model.dtype, c.model.remat = {model!r}, "float32", "none"  # the tiny model on CPU
    c.model.attention = c.model.decode_attention = "xla"
    c.data.task, c.data.train_problems, c.data.eval_problems = "arith", 12, 4
    c.format = "tiny"
    c.sft.steps, c.sft.batch_size, c.sft.examples = 4, 4, 16
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 1, -1, 1
    c.rollout.jax.slots, c.rollout.max_len = 8, 256
    c.rollout.jax.page_size, c.rollout.jax.kv_memory_gb = 0, 0.0                 # the recipe's 160 GiB pool, shrunk away
    c.mesh.devices_per_process = 0                                       # two 1-device processes, not 8-GPU hosts
    c.rl.steps, c.rl.batch_problems, c.rl.group_size, c.rl.oversample = 4, 2, 2, 2
    c.rl.micro_batches, c.rl.lr, c.rl.warmup_steps = 1, 1e-4, 1
    c.rl.max_staleness, c.rl.correction.names = 1, ("token_tis",)
    c.rollout.vllm.sync_wait = "export"  # the trainers wait for the export; process 0 lands it behind them
    c.rl.advantage.name, c.rl.roc.reject_uniform_groups = "test_alternating_signs", False
    c.stages = [dict(s, max_response_tokens=120, max_turns=2) for s in c.stages]
    c.stages[1]["start_step"], c.stages[2]["start_step"], c.stages[2]["filter_solved_k"] = 2, 3, 2
    c.sandbox.local.workers = 1
    c.eval.before_and_after = False
    c.checkpoint.every, c.checkpoint.keep = 1, 10
    return c
"""


@pytest.mark.slow
def test_the_paper_recipe_runs_as_a_slurm_job_survives_scancel_and_resumes(tmp_path, tiny_dir):
    if not os.path.exists(VLLM_PYTHON):
        pytest.fail(f"{VLLM_PYTHON} is missing: `make test` installs it (make venv-vllm)")
    cluster = SlurmCluster(str(tmp_path / "slurm"))
    try:
        _run_kill_and_resume(tmp_path, tiny_dir, cluster)
    finally:
        cluster.stop()


def _wait(predicate, timeout: float, what: str, poll_s: float = 1.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not after {timeout:g} s")
        time.sleep(poll_s)


def _run_kill_and_resume(tmp_path, tiny_dir, cluster):
    config = tmp_path / "shrunk_rstar2_agent_14b.py"
    config.write_text(CONFIG.format(model=tiny_dir))
    work = tmp_path / "run"
    # 4 of the 12 problems already pre-filtered (as after a crash mid pre-pass), two solved 2/2
    from rstar2_jax.data.tasks import DataConfig, make_task
    ids = [p.id for p in make_task(DataConfig(train_problems=12, eval_problems=4), seed=0).train_problems]
    (work / "prefilter").mkdir(parents=True)
    seeded = [{"id": i, "solved": n, "k": 2} for i, n in zip(ids[:4], (2, 0, 2, 1))]
    (work / "prefilter" / "stage2.jsonl").write_text("".join(json.dumps(r) + "\n" for r in seeded))

    ports = {"redis": free_port(), "vllm": free_port(), "fetch": free_port()}
    launch = [sys.executable, "-m", "rstar2_jax.launch", "slurm", f"--config={config}", f"--workdir={work}",
              "--nodes=1", "--learner_tasks_per_node=2", "--sandbox_nodes=1", "--sandbox_tasks_per_node=2",
              "--sandbox_concurrency=2", "--rollout_nodes=1", f"--vllm_python={VLLM_PYTHON}", "--cpu_kv_cache_gib=1",
              "--vllm_eager",  # half the server's start-up on CPU
              f"--redis_port={ports['redis']}", f"--vllm_port={ports['vllm']}", f"--fetch_port={ports['fetch']}"]
    # a request the cluster cannot place is refused before anything is written
    refused = subprocess.run(launch + ["--nodes=2", "--learner_nodes=2"], cwd=ROOT, env=cluster.env,
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "--nodes=2: the partition has 1 node(s)" in refused.stderr, refused.stderr
    assert not (work / "slurm").exists()
    done = subprocess.run(launch, cwd=ROOT, env=cluster.env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    first = re.search(r"submitted job (\d+)", done.stdout)[1]
    script = (work / "slurm" / "job.sh").read_text()
    assert "--config.sandbox.redis.url=$REDIS_URL" in script and "rstar2_jax.rollout.serve" in script
    assert "rstar2_jax.rollout.serve" in next(l for l in script.splitlines() if " --eager" in l)

    # while the job runs (from the trainer's first line on, not after checkpoint 2: the shrunk run
    # may finish its 4 steps within seconds of it), only the job's holders of its secret are served
    trainer_log = work / "slurm" / f"{first}.trainer.0.log"
    _wait(lambda: first not in cluster.jobs() or (trainer_log.exists() and "weight export served at"
                                                   in trainer_log.read_text()), 1200, "the trainer's export server")
    assert first in cluster.jobs(), open(work / "slurm" / f"{first}.out").read()[-3000:]
    _only_the_job_is_served(cluster, first, work, ports)
    # stop it once the first RL step is checkpointed (stages 1 and 2 and the pre-filter still to come:
    # three steps, ~10 s, for the scancel to land before the run's end; at checkpoint 2 a loaded
    # machine could finish the last two steps first)
    checkpoints = work / "checkpoints"
    _wait(lambda: (checkpoints / "1").exists() or first not in cluster.jobs(), 1200, "checkpoint 1", poll_s=0.2)
    assert first in cluster.jobs(), open(work / "slurm" / f"{first}.out").read()[-3000:]
    trainers = _trainer_pids(first)
    cluster.run("scancel", first)
    cluster.wait_gone(first, 120)
    assert not (checkpoints / "4").exists()
    _nothing_left_in_shm(trainers, ports)  # SIGTERM freed the trainer's exports and the fetcher's copies

    # the same script, submitted again, finishes the run from its last checkpoint
    second = cluster.run("sbatch", "--parsable", str(work / "slurm" / "job.sh")).stdout.strip().split(";")[0]
    _wait(lambda: second not in cluster.jobs() or _trainer_pids(second), 600, "the second job's trainers")
    trainers = _trainer_pids(second)
    cluster.wait_gone(second, 1200)
    _nothing_left_in_shm(trainers, ports)
    trainer_log = (work / "slurm" / f"{second}.trainer.0.log").read_text()
    assert cluster.exit_status(second) == 0, trainer_log[-3000:]
    assert "resumed from" in trainer_log
    assert (checkpoints / "4").exists()

    lines = rl_lines(work)
    steps = {l["step"]: l for l in lines}  # a step cut by the scancel is run again: its last line counts
    assert sorted(steps) == [0, 1, 2, 3] and [steps[s]["stage"] for s in range(4)] == [0, 0, 1, 2]
    assert all(l["staleness/max"] <= 1 for l in lines)
    assert all(steps[s]["kept_rollouts"] == 4 for s in range(4))  # both processes' halves: 2 problems x G
    assert all(l["sync/failures"] == 0 for l in lines)

    # the pre-filter: each problem once (only the primary process writes), the seeded lines kept,
    # both processes' halves of each problem's k rollouts counted
    rows = [json.loads(l) for l in (work / "prefilter" / "stage2.jsonl").read_text().splitlines()]
    assert sorted(r["id"] for r in rows) == sorted(ids) and rows[:4] == seeded
    assert all(0 <= r["solved"] <= 2 for r in rows)
    dropped = {i for i, n in read_results(str(work / "prefilter" / "stage2.jsonl")).items() if n == 2}
    assert {ids[0], ids[2]} <= dropped
    traces = read_traces(work / "traces")
    assert not set(traces[traces["step"] >= 3]["problem_id"]) & dropped

    # every part ran where the script put it: the sandbox workers served, the server reloaded weights
    sandbox_logs = "".join((work / "slurm" / f).read_text() for f in os.listdir(work / "slurm")
                           if f.startswith(f"{second}.sandbox."))
    assert "slots on redis://" in sandbox_logs
    vllm_log = (work / "slurm" / f"{second}.vllm.0.0.log").read_text()
    assert "ready: http://" in vllm_log


def _trainer_environments(job_id: str) -> dict[str, dict[bytes, bytes]]:
    """pid -> environment of the trainer processes of SLURM job `job_id` (other tests' trainers
    may run beside it; an environment is readable by its owner only)."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if b"rstar2_jax.train" in open(f"/proc/{pid}/cmdline", "rb").read():
                env = dict(v.split(b"=", 1) for v in open(f"/proc/{pid}/environ", "rb").read().split(b"\0") if b"=" in v)
                if env.get(b"SLURM_JOB_ID") == job_id.encode():
                    found[pid] = env
        except OSError:
            continue
    return found


def _trainer_pids(job_id: str) -> set[str]:
    return set(_trainer_environments(job_id))


def _nothing_left_in_shm(trainers: set[str], ports: dict):
    """A job's weights in /dev/shm are memory on a shared node: once it is gone, neither its
    trainers' exports (rstar2_sync_<pid>_...) nor its fetcher's copies may stay."""
    assert trainers
    left = [n for n in os.listdir("/dev/shm") if n == f"rstar2_pulled_{ports['fetch']}"
            or any(n.startswith(f"rstar2_sync_{pid}_") for pid in trainers)]
    assert not left, left


def _job_secret(job_id: str) -> str:
    """The secret, from the environment of the job's trainer process (readable by its owner only)."""
    for env in _trainer_environments(job_id).values():
        if b"RSTAR2_SECRET" in env:
            return env[b"RSTAR2_SECRET"].decode()
    raise AssertionError("no trainer process with RSTAR2_SECRET in its environment")


def _only_the_job_is_served(cluster, job_id, work, ports):
    secret = _job_secret(job_id)
    assert len(secret) >= 32
    export = re.search(r"weight export served at (http://\S+) for the fetchers \(they show the job secret\)",
                       (work / "slurm" / f"{job_id}.trainer.0.log").read_text())[1]
    export = "http://127.0.0.1:" + export.rsplit(":", 1)[1]  # it listens on every interface
    vllm, fetch = f"http://127.0.0.1:{ports['vllm']}", f"http://127.0.0.1:{ports['fetch']}"
    for url, method in ((f"{vllm}/v1/models", "GET"), (f"{vllm}/collective_rpc", "POST"), (f"{vllm}/health", "GET"),
                        (f"{fetch}/fetch", "POST"), (f"{fetch}/commit", "POST"), (f"{export}/", "GET")):
        body = {} if method == "POST" else None
        assert http_status(url, method=method, body=body) == 401, url
        assert http_status(url, method=method, body=body, secret="not-the-secret") == 401, url
    assert http_status(f"{vllm}/v1/models", secret=secret) == 200 and http_status(f"{export}/", secret=secret) == 200
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(port=ports["redis"], socket_timeout=5).ping()
    assert redis.Redis(port=ports["redis"], password=secret, socket_timeout=5).ping()
    # never where another user of the cluster could read it
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            assert secret.encode() not in open(f"/proc/{pid}/cmdline", "rb").read(), pid
        except OSError:
            continue
    assert secret not in (work / "slurm" / "job.sh").read_text()
    assert secret not in cluster.run("scontrol", "show", "job", "-d", job_id).stdout
