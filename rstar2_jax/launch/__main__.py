"""`python -m rstar2_jax.launch slurm --config=EXPERIMENT --workdir=DIR [roles] [--dry_run] [--config.x=y ...]`

Writes DIR/slurm/job.sh, a SLURM batch script for the whole run (launch/slurm.py), and submits
it with sbatch (--dry_run: prints it instead). Before anything is written the config is checked
for the learner's process count with every address the script will wire (`train --plan`), and
the placement against the job and the cluster (sinfo): every problem at once, exit status 2.
Running the same command again (or `sbatch DIR/slurm/job.sh`) resumes the run.
"""

from __future__ import annotations

import os
import subprocess
import sys

from absl import app, flags
from ml_collections import config_flags

from rstar2_jax.launch.slurm import Ports, Roles, SlurmJob, cluster_info, placement_problems, submit, write_script

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_CONFIG = config_flags.DEFINE_config_file("config", None, "the experiment config (a .py with get_config()), as for "
                                          "train; --config.x=y overrides are passed on to the trainer")
_WORKDIR = flags.DEFINE_string("workdir", None, "the run directory (on a filesystem every learner node sees)",
                               required=True)
_NODES = flags.DEFINE_integer("nodes", 0, "nodes of the job (0 = learner + rollout + sandbox nodes; fewer: roles "
                              "share nodes)")
_LEARNER_NODES = flags.DEFINE_integer("learner_nodes", 1, "nodes of the trainer's processes")
_LEARNER_TASKS = flags.DEFINE_integer("learner_tasks_per_node", 1, "trainer processes per learner node")
_ROLLOUT_NODES = flags.DEFINE_integer("rollout_nodes", 0, "nodes of vLLM servers (0: the embedded engine)")
_SERVERS = flags.DEFINE_integer("servers_per_node", 1, "vLLM servers per rollout node")
_TP = flags.DEFINE_integer("tensor_parallel", 1, "GPUs per vLLM server")
_SANDBOX_NODES = flags.DEFINE_integer("sandbox_nodes", 0, "CPU nodes of sandbox workers, Redis on the first (0: the "
                                      "trainer's local sandbox)")
_SANDBOX_TASKS = flags.DEFINE_integer("sandbox_tasks_per_node", 1, "sandbox worker processes per sandbox node")
_SANDBOX_CONCURRENCY = flags.DEFINE_integer("sandbox_concurrency", 64, "execution slots per sandbox worker")
_GPUS = flags.DEFINE_integer("gpus_per_node", 0, "GPUs to ask for per node (0: none)")
_PARTITION = flags.DEFINE_string("partition", "", "SLURM partition")
_ACCOUNT = flags.DEFINE_string("account", "", "SLURM account")
_TIME = flags.DEFINE_string("time", "", "time limit (e.g. 2-00:00:00)")
_JOB_NAME = flags.DEFINE_string("job_name", "", "job name (default: the run directory's name)")
_SBATCH_ARG = flags.DEFINE_multi_string("sbatch_arg", [], "an extra #SBATCH line, e.g. --qos=high (repeat)")
_VLLM_PYTHON = flags.DEFINE_string("vllm_python", "", "the vLLM venv's interpreter on the rollout nodes "
                                   "(default: rollout.serve's, $RSTAR2_VLLM_PYTHON or .venv-vllm)")
_MAX_MODEL_LEN = flags.DEFINE_integer("max_model_len", 0, "vLLM's max_model_len (0 = rollout.max_len)")
_CPU_KV = flags.DEFINE_integer("cpu_kv_cache_gib", 4, "vLLM CPU build: KV cache GiB")
_VLLM_ARG = flags.DEFINE_multi_string("vllm_arg", [], "extra argument for every vLLM server (repeat)")
_VLLM_EAGER = flags.DEFINE_bool("vllm_eager", False, "start the vLLM servers eager (rollout.serve --eager): twice "
                                "as fast on CPU nodes; leave off on GPUs")
_REDIS_PORT = flags.DEFINE_integer("redis_port", 6379, "Redis port")
_VLLM_PORT = flags.DEFINE_integer("vllm_port", 8000, "first vLLM port of a node (server k: + 2k)")
_FETCH_PORT = flags.DEFINE_integer("fetch_port", 8001, "first weight-fetcher port of a node (server k: + 2k)")
_REDIS_SERVER = flags.DEFINE_string("redis_server", "redis-server", "the redis-server binary on the sandbox node")
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "print the script (and write it), submit nothing")
_CHECK = flags.DEFINE_bool("check", True, "check the config with `train --plan` for the learner's processes first")


def _config_args(argv: list[str]) -> list[str]:
    """--config=PATH[:ARG] (the path made absolute) and every --config.x=y override, as given."""
    out = []
    for a in argv:
        if a.startswith("--config="):
            value = a[len("--config="):]
            path, sep, arg = value.partition(":")
            out.append(f"--config={os.path.abspath(path)}{sep}{arg}" if os.path.exists(path) else a)
        elif a.startswith("--config."):
            out.append(a)
    return out


def _plan_check(job: SlurmJob) -> str | None:
    """`train --plan` for the job's process count, with the addresses the script wires in
    (placeholders of the same form); its complaint, or None."""
    wired = []
    if job.roles.sandbox_nodes:
        wired += ["--config.sandbox.backend=redis", f"--config.sandbox.redis.url=redis://localhost:{job.ports.redis}/0"]
    if job.roles.rollout_nodes:  # engine by name: the launcher's rollout role is vLLM servers
        wired += ["--config.rollout.engine=vllm", f"--config.rollout.vllm.urls=http://localhost:{job.ports.vllm}",
                  "--config.rollout.vllm.sync=pull", "--config.rollout.vllm.sync_host=localhost",
                  f"--config.rollout.vllm.fetch_urls=http://localhost:{job.ports.fetch}"]
    cmd = [job.python, "-m", "rstar2_jax.train", f"--workdir={job.workdir}", "--plan",
           f"--num_processes={job.roles.learner_tasks}", *job.train_args, *wired]
    done = subprocess.run(cmd, cwd=job.repo, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        return (done.stderr.strip() or done.stdout.strip())[-3000:]
    return None


def main(argv):
    if len(argv) < 2 or argv[1] != "slurm":
        raise app.UsageError("usage: python -m rstar2_jax.launch slurm --config=... --workdir=... [flags]")
    if len(argv) > 2:
        raise app.UsageError(f"unexpected arguments {argv[2:]} (config overrides are --config.x=y)")
    cfg = _CONFIG.value
    if cfg is None:
        raise app.UsageError("--config is required, e.g. --config=experiments/tiny_arith.py")
    workdir = os.path.abspath(_WORKDIR.value)
    roles = Roles(_LEARNER_NODES.value, _LEARNER_TASKS.value, _ROLLOUT_NODES.value, _SERVERS.value, _TP.value,
                  _SANDBOX_NODES.value, _SANDBOX_TASKS.value, _SANDBOX_CONCURRENCY.value)
    job = SlurmJob(
        name=_JOB_NAME.value or os.path.basename(workdir.rstrip("/")) or "rstar2", workdir=workdir, repo=ROOT,
        python=sys.executable, train_args=tuple(_config_args(sys.argv[1:])), roles=roles,
        nodes=_NODES.value or roles.wanted_nodes(), model_path=str(cfg.model.path),
        vllm_python=_VLLM_PYTHON.value, dtype=str(cfg.model.dtype),
        max_model_len=_MAX_MODEL_LEN.value or int(cfg.rollout.max_len), lora_rank=int(cfg.model.lora.rank),
        cpu_kv_cache_gib=_CPU_KV.value, vllm_args=tuple(_VLLM_ARG.value), vllm_eager=_VLLM_EAGER.value,
        gpus_per_node=_GPUS.value,
        ports=Ports(_REDIS_PORT.value, _VLLM_PORT.value, _FETCH_PORT.value), redis_server=_REDIS_SERVER.value,
        partition=_PARTITION.value, account=_ACCOUNT.value, time=_TIME.value, sbatch_args=tuple(_SBATCH_ARG.value))
    cluster = cluster_info(job.partition)
    problems = placement_problems(job, cluster)
    if problems:
        print("the job cannot be placed:\n  " + "\n  ".join(problems), file=sys.stderr)
        sys.exit(2)
    if _CHECK.value and (complaint := _plan_check(job)):
        print(f"the config does not pass `train --plan` for {roles.learner_tasks} process(es):\n{complaint}",
              file=sys.stderr)
        sys.exit(2)
    script = write_script(job)
    if _DRY_RUN.value:
        print(open(script).read(), end="")
        if cluster is None:  # the partition's nodes, CPUs and GPUs were not checked against the job
            print("# no SLURM here (sinfo did not answer): the job's nodes, CPUs and GPUs were not checked against "
                  "the partition", file=sys.stderr)
        print(f"# written to {script}; submit with: sbatch {script}", file=sys.stderr)
        return
    if cluster is None:
        print("no SLURM here (sinfo did not answer): the script is written, submit it where there is one: "
              f"sbatch {script}", file=sys.stderr)
        sys.exit(2)
    job_id = submit(script)
    print(f"submitted job {job_id}: {script}\n  logs: {job.log_dir}/{job_id}.*\n  stop: scancel {job_id}\n"
          f"  resume after a stop or a crash: sbatch {script}  (or this command again)")


if __name__ == "__main__":
    app.run(main)
