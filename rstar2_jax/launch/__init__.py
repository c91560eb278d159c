"""Launchers: one command that writes (and submits) the job running a whole run on a cluster.

    python -m rstar2_jax.launch slurm --config=experiments/rstar2_agent_14b.py:MODEL,DATA \\
        --workdir=/shared/runs/x --learner_nodes=4 --rollout_nodes=2 --sandbox_nodes=1 --dry_run

slurm.py writes the batch script (pure: SlurmJob -> text); __main__.py reads the flags, checks the
config for the learner's processes (train --plan) and the placement against the cluster
(sinfo), then writes the script and sbatch-es it unless --dry_run. wait.py is what the script
calls to wait for Redis and the vLLM servers.
"""
