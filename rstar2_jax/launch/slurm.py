"""One SLURM batch script that starts a whole run: Redis and sandbox workers, vLLM servers with
their weight fetchers, and the trainer processes, with every address wired.

The job holds `nodes` nodes. Roles take node indices in order (sandbox, rollout, learner), modulo
the job's nodes: with as many nodes as the roles ask for each role has its own, with fewer they
share (a one-node job runs everything on its node). Each role is one `srun --overlap` step (steps
share the allocation), started in the background and waited for (Redis answers, each server's
/health); then the trainer's step runs in the foreground and its exit status is the job's. The
trainer finds its coordinator from SLURM (jax.distributed.initialize()).

A resubmission of the same script resumes the run from its last checkpoint (the trainer's own
resume); `python -m rstar2_jax.launch slurm ...` with the same flags writes the same script.

Every service of the job answers only the job: the script makes a new secret when the job starts
and exports it as $RSTAR2_SECRET (sandbox/job_secret.py), which every step inherits. Redis reads
it as its requirepass from stdin, the vLLM servers, their weight fetchers and the trainer's export
server ask for it as a bearer token; it is never on a command line, where `ps` and `scontrol`
would show it to the cluster's other users (nor in the script, which `scontrol write batch_script`
shows).
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import subprocess


@dataclasses.dataclass(frozen=True)
class Roles:
    """How many nodes each role takes, and what runs on each of its nodes."""
    learner_nodes: int = 1
    learner_tasks_per_node: int = 1      # trainer processes per node (one per node for GPU hosts in JAX)
    rollout_nodes: int = 0               # 0: the trainer's embedded engine
    servers_per_node: int = 1            # vLLM servers per rollout node (one per GPU or TP group)
    tensor_parallel: int = 1             # GPUs per vLLM server
    sandbox_nodes: int = 0               # 0: the trainer's local sandbox
    sandbox_tasks_per_node: int = 1      # `python -m sandbox worker` processes per sandbox node
    sandbox_concurrency: int = 64        # execution slots per worker process

    @property
    def learner_tasks(self) -> int:
        return self.learner_nodes * self.learner_tasks_per_node

    def wanted_nodes(self) -> int:
        return self.learner_nodes + self.rollout_nodes + self.sandbox_nodes

    def node_indices(self, nodes: int) -> dict[str, list[int]]:
        """Each role's node indices in the job (sandbox first, then rollout, then learner)."""
        out, start = {}, 0
        for role, n in (("sandbox", self.sandbox_nodes), ("rollout", self.rollout_nodes),
                        ("learner", self.learner_nodes)):
            out[role] = [(start + i) % nodes for i in range(n)]
            start += n
        return out


@dataclasses.dataclass(frozen=True)
class Ports:
    redis: int = 6379
    vllm: int = 8000                     # server k of a node listens on vllm + 2k
    fetch: int = 8001                    # its weight fetcher on fetch + 2k


@dataclasses.dataclass(frozen=True)
class SlurmJob:
    name: str
    workdir: str                         # absolute; the run directory (checkpoints, logs, the script)
    repo: str                            # absolute; where `python -m rstar2_jax...` runs
    python: str                          # the trainer's and workers' interpreter
    train_args: tuple[str, ...]          # --config=... and its overrides, as the user gave them
    roles: Roles
    nodes: int
    model_path: str = ""                 # what the vLLM servers load first (the trainer syncs its own)
    vllm_python: str = ""                # the vLLM venv's interpreter ('' = rollout.serve's default)
    dtype: str = "auto"                  # the servers' dtype: the run's model.dtype (the probe compares them)
    max_model_len: int = 4096
    cpu_kv_cache_gib: int = 4
    vllm_args: tuple[str, ...] = ()
    vllm_eager: bool = False             # rollout.serve --eager (a CPU quick start)
    lora_rank: int = 0                   # rollout.serve --lora_rank: the run's model.lora.rank
    gpus_per_node: int = 0
    ports: Ports = Ports()
    redis_server: str = "redis-server"
    partition: str = ""
    account: str = ""
    time: str = ""
    sbatch_args: tuple[str, ...] = ()

    @property
    def log_dir(self) -> str:
        return os.path.join(self.workdir, "slurm")

    @property
    def script_path(self) -> str:
        return os.path.join(self.log_dir, "job.sh")


@dataclasses.dataclass(frozen=True)
class ClusterInfo:
    """What `sinfo` says of a partition: its nodes, and the fewest CPUs and GPUs any node has."""
    nodes: int
    cpus_per_node: int
    gpus_per_node: int


def placement_problems(job: SlurmJob, cluster: ClusterInfo | None = None) -> list[str]:
    """Everything the job cannot place, each naming the flag to change (all at once)."""
    r, out = job.roles, []
    for flag, value in (("--learner_nodes", r.learner_nodes), ("--learner_tasks_per_node", r.learner_tasks_per_node),
                        ("--servers_per_node", r.servers_per_node), ("--tensor_parallel", r.tensor_parallel),
                        ("--sandbox_tasks_per_node", r.sandbox_tasks_per_node),
                        ("--sandbox_concurrency", r.sandbox_concurrency), ("--nodes", job.nodes)):
        if value < 1:
            out.append(f"{flag}={value}: must be at least 1")
    for flag, value in (("--rollout_nodes", r.rollout_nodes), ("--sandbox_nodes", r.sandbox_nodes),
                        ("--gpus_per_node", job.gpus_per_node)):
        if value < 0:
            out.append(f"{flag}={value}: must be 0 or more")
    if out:
        return out
    for flag, value in (("--learner_nodes", r.learner_nodes), ("--rollout_nodes", r.rollout_nodes),
                        ("--sandbox_nodes", r.sandbox_nodes)):
        if value > job.nodes:
            out.append(f"{flag}={value} exceeds the job's {job.nodes} nodes (--nodes): a role's nodes must be "
                       "distinct")
    if job.gpus_per_node:
        if r.learner_tasks_per_node > job.gpus_per_node:
            out.append(f"--learner_tasks_per_node={r.learner_tasks_per_node} is more trainer processes than the "
                       f"{job.gpus_per_node} GPUs of a node (--gpus_per_node)")
        if r.rollout_nodes and r.servers_per_node * r.tensor_parallel > job.gpus_per_node:
            out.append(f"--servers_per_node={r.servers_per_node} x --tensor_parallel={r.tensor_parallel} GPUs is "
                       f"more than a node's {job.gpus_per_node} (--gpus_per_node)")
        shared = set(r.node_indices(job.nodes)["learner"]) & set(r.node_indices(job.nodes)["rollout"])
        if shared and r.learner_tasks_per_node + r.servers_per_node * r.tensor_parallel > job.gpus_per_node:
            out.append(f"learner and rollout share {len(shared)} node(s) but need {r.learner_tasks_per_node} + "
                       f"{r.servers_per_node * r.tensor_parallel} GPUs there, more than {job.gpus_per_node}: raise "
                       f"--nodes to {r.wanted_nodes()}")
    if r.rollout_nodes and not job.model_path:
        out.append("--rollout_nodes needs model.path in the config: the vLLM servers load it before the trainer's "
                   "first sync (the tiny model of model.path='' is built by the trainer, after the servers start)")
    if cluster is not None:
        if job.nodes > cluster.nodes:
            out.append(f"--nodes={job.nodes}: the partition has {cluster.nodes} node(s) (sinfo)")
        if job.gpus_per_node > cluster.gpus_per_node:
            out.append(f"--gpus_per_node={job.gpus_per_node}: the partition's nodes have {cluster.gpus_per_node} GPU(s)")
        tasks = max(r.learner_tasks_per_node, r.sandbox_tasks_per_node if r.sandbox_nodes else 0)
        if tasks > cluster.cpus_per_node:
            out.append(f"{tasks} tasks on a node is more than its {cluster.cpus_per_node} CPUs")
    return out


def cluster_info(partition: str = "") -> ClusterInfo | None:
    """The partition's size from `sinfo` (None where there is no SLURM to ask)."""
    cmd = ["sinfo", "-h", "-o", "%D %c %G"] + (["-p", partition] if partition else [])
    try:
        lines = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=True).stdout.split("\n")
    except (OSError, subprocess.SubprocessError):
        return None
    groups = [line.split(None, 2) for line in lines if line.strip()]  # nodes, CPUs ("64+"), gres
    if not groups:
        return None
    return ClusterInfo(nodes=sum(int(g[0]) for g in groups), cpus_per_node=min(int(g[1].rstrip("+")) for g in groups),
                       gpus_per_node=min(_gpus(g[2] if len(g) > 2 else "") for g in groups))


def _gpus(gres: str) -> int:
    """GPUs in a gres string such as 'gpu:8', 'gpu:h100:8(S:0-1)' or '(null)'."""
    total = 0
    for part in gres.split(","):
        fields = part.split("(")[0].split(":")
        if fields[0] == "gpu" and fields[-1].isdigit():
            total += int(fields[-1])
    return total


def _q(x) -> str:
    return shlex.quote(str(x))


def _hosts(indices: list[int]) -> str:
    """The script's expression for the comma-separated hostnames of these node indices."""
    return "$(hosts " + " ".join(map(str, indices)) + ")"


def _cpus_per_task(tasks_per_node: int) -> str:
    """--cpus-per-task: the node's CPUs split between a step's tasks on it (at least one)."""
    return f"--cpus-per-task=$(( CPUS / {tasks_per_node} > 0 ? CPUS / {tasks_per_node} : 1 ))"


_STEP = "srun --overlap --kill-on-bad-exit=1"


def batch_script(job: SlurmJob) -> str:
    """The batch script (bash) of `job`: the #SBATCH header, the job's set-up, each role's steps."""
    roles = job.roles.node_indices(job.nodes)
    # the user's arguments as given (the file, then its overrides), then what the script wires in,
    # which the shell expands (the addresses are known only when the job runs)
    train = [_q(a) for a in (f"--workdir={job.workdir}", *job.train_args, "--config.distributed=True")]
    body = _job_setup(job, roles)
    if job.roles.sandbox_nodes:
        body += _sandbox_steps(job, roles, train)
    if job.roles.rollout_nodes:
        body += _rollout_steps(job, roles, train)
    body += _trainer_step(job, roles, train)
    return "\n".join(_header(job) + [""] + body) + "\n"


def _header(job: SlurmJob) -> list[str]:
    head = [
        "#!/bin/bash",
        f"#SBATCH --job-name={job.name}",
        f"#SBATCH --nodes={job.nodes}",
        "#SBATCH --exclusive",
        f"#SBATCH --output={job.log_dir}/%j.out",
        "#SBATCH --open-mode=append",
    ]
    if job.gpus_per_node:
        head.append(f"#SBATCH --gpus-per-node={job.gpus_per_node}")
    for flag, value in (("partition", job.partition), ("account", job.account), ("time", job.time)):
        if value:
            head.append(f"#SBATCH --{flag}={value}")
    head += [f"#SBATCH {a}" for a in job.sbatch_args]
    return head


def _job_setup(job: SlurmJob, roles: dict[str, list[int]]) -> list[str]:
    """Node names, the steps' clean-up at the end, the job's secret."""
    py, logs = _q(job.python), _q(job.log_dir)
    body = [
        "# Written by `python -m rstar2_jax.launch slurm`; `sbatch` it again to resume the run.",
        "set -uo pipefail",
        f"cd {_q(job.repo)}",
        f"mkdir -p {logs}",
        'mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")',
        'host() { echo "${NODES[$(( $1 % ${#NODES[@]} ))]}"; }',
        'hosts() { local out=(); for i in "$@"; do out+=("$(host "$i")"); done; local IFS=,; echo "${out[*]}"; }',
        "STEPS=()",
        # at the end the services get SIGTERM through SLURM, so each frees what it holds (the fetcher's
        # copies, memory in /dev/shm); killing an srun instead makes SLURM SIGKILL its tasks at once
        'alive() { for pid in "${STEPS[@]}"; do kill -0 "$pid" 2>/dev/null && return 0; done; return 1; }',
        'cleanup() { scancel --signal=TERM "$SLURM_JOB_ID" 2>/dev/null; for _ in $(seq 30); do alive || break; sleep 1; '
        'done; for pid in "${STEPS[@]}"; do kill "$pid" 2>/dev/null; done; wait; }',
        "trap cleanup EXIT",
        'trap "exit 143" TERM',
        "CPUS=${SLURM_CPUS_ON_NODE:-1}",
        "# the job's secret: every service below asks for it; the steps inherit it (never an argument)",
        f"RSTAR2_SECRET=$({py} -c 'import secrets; print(secrets.token_urlsafe(32))') && [ -n \"$RSTAR2_SECRET\" ] "
        "|| { echo 'could not make the job secret' >&2; exit 1; }",
        "export RSTAR2_SECRET",
        f"echo \"job $SLURM_JOB_ID on $SLURM_JOB_NODELIST: sandbox {roles['sandbox']} rollout {roles['rollout']} "
        f"learner {roles['learner']} (node indices)\"",
    ]
    return body


def _sandbox_steps(job: SlurmJob, roles: dict[str, list[int]], train: list[str]) -> list[str]:
    """Redis on the first sandbox node, then the sandbox workers; the trainer's flags for them into `train`."""
    r, p, step = job.roles, job.ports, _STEP
    py, logs = _q(job.python), _q(job.log_dir)
    body = []
    body += [
        "",
        "# Redis (the sandbox queue) on the first sandbox node, then the sandbox workers",
        f"REDIS_HOST=$(host {roles['sandbox'][0]})",
        f"REDIS_URL=redis://$REDIS_HOST:{p.redis}/0",
        # its password from stdin ("-": the configuration read from there), not its arguments
        "printf 'requirepass %s\\n' \"$RSTAR2_SECRET\" | "
        f"{step} --nodes=1 --ntasks=1 --nodelist=$REDIS_HOST --output={logs}/%j.redis.log "
        f"{_q(job.redis_server)} - --port {p.redis} --bind 0.0.0.0 --protected-mode no --save '' --appendonly no &",
        "STEPS+=($!)",
        f"{py} -m rstar2_jax.launch.wait --timeout 120 --alive $! \"$REDIS_URL\" || exit 1",
        f"{step} --nodes={r.sandbox_nodes} --ntasks={r.sandbox_nodes * r.sandbox_tasks_per_node} "
        f"--ntasks-per-node={r.sandbox_tasks_per_node} {_cpus_per_task(r.sandbox_tasks_per_node)} "
        f"--nodelist={_hosts(roles['sandbox'])} --output={logs}/%j.sandbox.%t.log "
        f"{py} -m sandbox worker --redis \"$REDIS_URL\" --concurrency {r.sandbox_concurrency} &",
        "STEPS+=($!)",
    ]
    train += ["--config.sandbox.backend=redis", '"--config.sandbox.redis.url=$REDIS_URL"']
    return body


def _rollout_steps(job: SlurmJob, roles: dict[str, list[int]], train: list[str]) -> list[str]:
    """vLLM servers with their weight fetchers; the trainer's flags for them into `train`."""
    r, p, step = job.roles, job.ports, _STEP
    py, logs = _q(job.python), _q(job.log_dir)
    body = []
    body += ["", "# vLLM servers, each with a weight fetcher (sync=pull: no shared filesystem needed)",
             "VLLM_URLS=()", "FETCH_URLS=()"]
    for i in roles["rollout"]:
        for k in range(r.servers_per_node):
            # engine by name: the launcher's rollout role is vLLM servers (the embedded engine needs none)
            port, fetch = p.vllm + 2 * k, p.fetch + 2 * k
            serve = [f"{py} -m rstar2_jax.rollout.serve", f"--model={_q(job.model_path)}", "--host=0.0.0.0",
                     f"--port={port}", f"--fetch_port={fetch}", f"--dtype={job.dtype}",
                     f"--max_model_len={job.max_model_len}",
                     f"--tensor_parallel_size={r.tensor_parallel}", f"--cpu_kv_cache_gib={job.cpu_kv_cache_gib}"]
            if job.vllm_python:
                serve.append(f"--python={_q(job.vllm_python)}")
            serve += [f"--lora_rank={job.lora_rank}"] * bool(job.lora_rank)
            serve += ["--eager"] * job.vllm_eager + [f"--vllm_arg={_q(a)}" for a in job.vllm_args]
            body += [
                f"H=$(host {i})",
                f"{step} --nodes=1 --ntasks=1 --nodelist=$H --output={logs}/%j.vllm.{i}.{k}.log {' '.join(serve)} &",
                "STEPS+=($!)",
                f"VLLM_URLS+=(http://$H:{port})", f"FETCH_URLS+=(http://$H:{fetch})",
            ]
    body += [f"{py} -m rstar2_jax.launch.wait --timeout 1800 $(printf -- '--alive %s ' \"${{STEPS[@]}}\") "
             f"$(printf '%s/health ' \"${{VLLM_URLS[@]}}\") || exit 1"]
    train += ["--config.rollout.engine=vllm", "--config.rollout.vllm.sync=pull",
              f'"--config.rollout.vllm.sync_host=$(host {roles["learner"][0]})"',
              '$(printf -- "--config.rollout.vllm.urls=%s " "${VLLM_URLS[@]}")',
              '$(printf -- "--config.rollout.vllm.fetch_urls=%s " "${FETCH_URLS[@]}")']
    return body


def _trainer_step(job: SlurmJob, roles: dict[str, list[int]], train: list[str]) -> list[str]:
    r, step = job.roles, _STEP
    py, logs = _q(job.python), _q(job.log_dir)
    return [
        "",
        "# the trainer: its exit status is the job's",
        f"{step} --nodes={r.learner_nodes} --ntasks={r.learner_tasks} --ntasks-per-node={r.learner_tasks_per_node} "
        f"{_cpus_per_task(r.learner_tasks_per_node)} --nodelist={_hosts(roles['learner'])} "
        f"--output={logs}/%j.trainer.%t.log {py} -m rstar2_jax.train {' '.join(train)} &",
        "TRAINER=$!",
        'wait "$TRAINER"',
        "STATUS=$?",
        'echo "trainer exited with $STATUS"',
        "exit $STATUS",
    ]


def write_script(job: SlurmJob) -> str:
    os.makedirs(job.log_dir, exist_ok=True)
    tmp = job.script_path + ".tmp"
    with open(tmp, "w") as f:
        f.write(batch_script(job))
    os.chmod(tmp, 0o755)
    os.replace(tmp, job.script_path)
    return job.script_path


def submit(script: str) -> str:
    """sbatch the script; its job id."""
    done = subprocess.run(["sbatch", "--parsable", script], capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise RuntimeError(f"sbatch refused the job: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout.strip().split(";")[0]
