"""The SLURM launcher's script and placement checks, without a cluster (the end-to-end run on a
one-node SLURM cluster is tests/rl/test_scale_out.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rstar2_jax.launch.slurm import ClusterInfo, Ports, Roles, SlurmJob, _gpus, batch_script, placement_problems

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def job(**kw) -> SlurmJob:
    roles = kw.pop("roles", Roles(learner_nodes=2, rollout_nodes=1, servers_per_node=2, sandbox_nodes=1,
                                  sandbox_tasks_per_node=2))
    base = dict(name="x", workdir="/shared/runs/x", repo="/repo", python="/venv/bin/python",
                train_args=("--config=/repo/experiments/rstar2_agent_14b.py:/ckpt,/data/train.parquet",
                            "--config.rl.steps=5"),
                roles=roles, nodes=roles.wanted_nodes(), model_path="/ckpt", dtype="bfloat16", gpus_per_node=8,
                ports=Ports(6379, 8000, 8001))
    base.update(kw)
    return SlurmJob(**base)


@given(st.integers(0, 4), st.integers(0, 4), st.integers(1, 4), st.integers(1, 12))
def test_roles_take_distinct_nodes_when_the_job_has_enough_and_wrap_when_it_has_fewer(sandbox, rollout, learner,
                                                                                      nodes):
    roles = Roles(learner_nodes=learner, rollout_nodes=rollout, sandbox_nodes=sandbox)
    placed = roles.node_indices(nodes)
    assert [len(placed[r]) for r in ("sandbox", "rollout", "learner")] == [sandbox, rollout, learner]
    every = [i for r in placed.values() for i in r]
    assert all(0 <= i < nodes for i in every)
    if nodes >= roles.wanted_nodes():
        assert len(set(every)) == len(every)  # no two roles on one node
    for indices in placed.values():
        if len(indices) <= nodes:
            assert len(set(indices)) == len(indices)  # a role never uses a node twice


def test_the_script_wires_every_address_and_is_valid_bash():
    text = batch_script(job())
    assert "#SBATCH --nodes=4" in text and "#SBATCH --gpus-per-node=8" in text
    assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0
    lines = text.splitlines()
    redis = next(line for line in lines if "redis-server" in line)
    assert "--nodelist=$REDIS_HOST" in redis and "--port 6379" in redis
    sandbox = next(line for line in lines if "-m sandbox worker" in line)
    assert "--nodes=1 --ntasks=2 --ntasks-per-node=2" in sandbox and '--redis "$REDIS_URL"' in sandbox
    servers = [line for line in lines if "rstar2_jax.rollout.serve" in line]
    assert len(servers) == 2 and "--port=8000" in servers[0] and "--port=8002" in servers[1]
    assert all("--dtype=bfloat16" in s and "--model=/ckpt" in s for s in servers)
    assert "VLLM_URLS+=(http://$H:8000)" in text and "FETCH_URLS+=(http://$H:8003)" in text
    trainer = next(line for line in lines if "rstar2_jax.train" in line)
    assert "--nodes=2 --ntasks=2 --ntasks-per-node=1 --nodelist=$(hosts 2 3)" in trainer.replace(
        " --cpus-per-task=$(( CPUS / 1 > 0 ? CPUS / 1 : 1 ))", "")
    for wired in ("--config.sandbox.backend=redis", '"--config.sandbox.redis.url=$REDIS_URL"', "--config.rollout.engine=vllm",
                  "--config.rollout.vllm.sync=pull", '"--config.rollout.vllm.sync_host=$(host 2)"',
                  "--config.rl.steps=5", "--config.distributed=True"):
        assert wired in trainer, wired
    assert trainer.index("--config=/repo/experiments") < trainer.index("--config.rl.steps=5")
    # the user's own arguments reach the trainer as typed: the shell expands only what the script wires
    odd = batch_script(job(train_args=("--config=/repo/x.py", "--config.run_name=a$b c")))
    assert "'--config.run_name=a$b c'" in odd


def test_a_one_node_job_puts_every_role_on_its_node():
    assert placement_problems(job(nodes=1, gpus_per_node=0)) == [
        "--learner_nodes=2 exceeds the job's 1 nodes (--nodes): a role's nodes must be distinct"]
    roles = Roles(learner_nodes=1, learner_tasks_per_node=2, rollout_nodes=1, sandbox_nodes=1)
    assert placement_problems(job(roles=roles, nodes=1, gpus_per_node=0)) == []
    assert "sandbox [0] rollout [0] learner [0]" in batch_script(job(roles=roles, nodes=1, gpus_per_node=0))


def test_placement_problems_are_all_named_at_once():
    roles = Roles(learner_nodes=2, learner_tasks_per_node=9, rollout_nodes=1, servers_per_node=4, tensor_parallel=4,
                  sandbox_nodes=1)
    problems = placement_problems(job(roles=roles, model_path=""), ClusterInfo(nodes=2, cpus_per_node=8,
                                                                                gpus_per_node=4))
    text = "\n".join(problems)
    assert "--learner_tasks_per_node=9 is more trainer processes than the 8 GPUs" in text
    assert "--servers_per_node=4 x --tensor_parallel=4 GPUs is more than a node's 8" in text
    assert "--rollout_nodes needs model.path" in text
    assert "--nodes=4: the partition has 2 node(s)" in text
    assert "--gpus_per_node=8: the partition's nodes have 4 GPU(s)" in text
    assert "9 tasks on a node is more than its 8 CPUs" in text
    assert placement_problems(job(roles=Roles(learner_nodes=0), nodes=1)) == ["--learner_nodes=0: must be at least 1"]


@pytest.mark.parametrize("gres,gpus", [("(null)", 0), ("gpu:8", 8), ("gpu:h100:8(S:0-1)", 8), ("gpu:a:2,gpu:b:2", 4)])
def test_gpus_are_read_from_sinfo_gres(gres, gpus):
    assert _gpus(gres) == gpus


def test_dry_run_checks_the_config_and_prints_the_script_without_slurm(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "SLURM_CONF"}
    args = [sys.executable, "-m", "rstar2_jax.launch", "slurm", "--config=experiments/tiny_arith.py",
            f"--workdir={tmp_path / 'run'}", "--sandbox_nodes=1", "--learner_tasks_per_node=2", "--nodes=1"]
    done = subprocess.run(args + ["--dry_run", "--config.rl.steps=3"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("#!/bin/bash") and "--config.rl.steps=3" in done.stdout
    assert (tmp_path / "run" / "slurm" / "job.sh").read_text() == done.stdout
    # the partition checks that could not run are said to be skipped (issue 80)
    assert "no SLURM here (sinfo did not answer): the job's nodes, CPUs and GPUs were not checked" in done.stderr
    bad = subprocess.run(args + ["--dry_run", "--config.rollout.max_len=64"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert bad.returncode == 2 and "does not pass `train --plan` for 2 process(es)" in bad.stderr
    assert "max_response_tokens" in bad.stderr


def test_eager_vllm_servers_only_when_asked_and_the_server_command_they_run():
    from rstar2_jax.rollout.engines.vllm_engine.server import ServerOptions, server_command

    def serve_lines(text):
        return [line for line in text.splitlines() if "rstar2_jax.rollout.serve" in line]

    assert all("--eager" not in s for s in serve_lines(batch_script(job())))
    assert all(" --eager " in s for s in serve_lines(batch_script(job(vllm_eager=True))))
    argv, env = server_command("/m", ServerOptions(eager=True))  # what `rollout.serve --eager` starts
    assert "--enforce-eager" in argv and argv[argv.index("--distributed-executor-backend") + 1] == "uni"
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"  # without it vLLM's CPU platform turns "uni" back to "mp"
    argv, env = server_command("/m", ServerOptions(eager=True, tensor_parallel_size=2))
    assert "--enforce-eager" in argv and "uni" not in argv and "VLLM_ENABLE_V1_MULTIPROCESSING" not in env
    argv, env = server_command("/m", ServerOptions())
    assert "--enforce-eager" not in argv and "VLLM_ENABLE_V1_MULTIPROCESSING" not in env


def test_the_job_makes_its_own_secret_and_hands_it_to_redis_on_stdin_not_on_a_command_line():
    text = batch_script(job())
    lines = text.splitlines()
    made = [line for line in lines if line.startswith("RSTAR2_SECRET=")]
    assert len(made) == 1 and "export RSTAR2_SECRET" in lines
    assert lines.index("export RSTAR2_SECRET") < min(i for i, line in enumerate(lines) if line.startswith("srun")
                                                     or "| srun" in line)  # before any service starts
    redis = next(line for line in lines if "redis-server" in line)
    assert redis.startswith("printf 'requirepass %s\\n' \"$RSTAR2_SECRET\" | srun ") and "redis-server - --port" in redis
    assert sum("$RSTAR2_SECRET" in line for line in lines) == 2  # its test, and Redis's stdin: never an argument
    # the lines that make it, run: a fresh secret each time the job starts
    secrets_made = set()
    for _ in range(2):
        script = "\n".join([line.replace("/venv/bin/python", sys.executable) for line in made]
                           + ["export RSTAR2_SECRET", 'echo "$RSTAR2_SECRET"'])
        secrets_made.add(subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True).stdout.strip())
    assert len(secrets_made) == 2 and all(len(s) >= 40 for s in secrets_made)


def test_wait_shows_redis_the_job_secret_and_gives_up_once_a_step_has_ended():
    from tests.sandbox.redis_server import RedisServer, free_port

    server = RedisServer(password="job-s3cret").start()
    try:
        env = {k: v for k, v in os.environ.items() if k != "RSTAR2_SECRET"}
        wait = [sys.executable, "-m", "rstar2_jax.launch.wait", "--timeout", "3", server.url]
        without = subprocess.run(wait, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
        assert without.returncode == 1 and "no answer within 3 s" in without.stderr
        holder = subprocess.run(wait, cwd=ROOT, env={**env, "RSTAR2_SECRET": "job-s3cret"}, capture_output=True,
                                text=True, timeout=60)
        assert holder.returncode == 0 and "up: " in holder.stdout, holder.stderr
    finally:
        server.stop()
    step = subprocess.Popen(["sleep", "0.5"])  # a server's step that failed to start
    start = time.monotonic()
    gone = subprocess.run([sys.executable, "-m", "rstar2_jax.launch.wait", "--timeout", "600", "--alive", str(step.pid),
                           f"http://127.0.0.1:{free_port()}/health"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    step.wait()
    assert gone.returncode == 1 and f"process(es) {step.pid} ended before" in gone.stderr
    assert time.monotonic() - start < 60  # not the 600 s timeout
