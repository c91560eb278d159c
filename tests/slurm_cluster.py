"""A one-node SLURM cluster on this machine, started by a test: munged with its own key and
socket, slurmctld and slurmd in the foreground, all state under one directory, on free ports.
The Debian packages (slurm-wlm, munge) are installed by `make test`; everything runs as root."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time

from rstar2_jax.rollout.engines.vllm_engine.server import free_port

CONF = """ClusterName=rstar2test
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge.sock
SlurmUser=root
SlurmdUser=root
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
KillWait=5
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={memory_mb} State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


class SlurmCluster:
    def __init__(self, root: str):
        for tool in ("munged", "slurmctld", "slurmd", "sbatch"):
            if shutil.which(tool) is None:
                raise RuntimeError(f"{tool} is missing: `make test` installs slurm-wlm and munge")
        self.root = root
        self.host = socket.gethostname().split(".")[0]
        for d in ("state", "spool"):
            os.makedirs(os.path.join(root, d), exist_ok=True)
        key = os.path.join(root, "munge.key")
        with open(key, "wb") as f:
            f.write(os.urandom(1024))
        os.chmod(key, 0o600)
        memory_mb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20 * 8 // 10
        self.conf = os.path.join(root, "slurm.conf")
        with open(self.conf, "w") as f:
            f.write(CONF.format(host=self.host, ctld_port=free_port(), d_port=free_port(), root=root,
                                cpus=os.cpu_count(), memory_mb=memory_mb))
        self.env = {**os.environ, "SLURM_CONF": self.conf}
        self.procs = []
        subprocess.run(["munged", f"--key-file={key}", f"--socket={root}/munge.sock", f"--pid-file={root}/munged.pid",
                        f"--log-file={root}/munged.log", f"--seed-file={root}/munged.seed", "--force"],
                       check=True, timeout=30)
        logs = open(os.path.join(root, "daemons.log"), "w")
        self.procs.append(subprocess.Popen(["slurmctld", "-D", "-i", "-f", self.conf], env=self.env, stdout=logs,
                                           stderr=subprocess.STDOUT))
        self.procs.append(subprocess.Popen(["slurmd", "-D", "-N", self.host, "-f", self.conf], env=self.env,
                                           stdout=logs, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            out = self.run("sinfo", "-h", "-o", "%t", check=False).stdout.split()
            if out and out[0] == "idle":
                return
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"the SLURM node did not become idle: {open(os.path.join(root, 'slurmctld.log')).read()[-2000:]}")

    def run(self, *cmd, check=True, timeout=60) -> subprocess.CompletedProcess:
        return subprocess.run(list(cmd), env=self.env, capture_output=True, text=True, check=check, timeout=timeout)

    def jobs(self) -> list[str]:
        return self.run("squeue", "-h", "-o", "%i").stdout.split()

    def wait_gone(self, job_id: str, timeout: float):
        deadline = time.monotonic() + timeout
        while job_id in self.jobs():
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still in the queue after {timeout:g} s")
            time.sleep(1.0)

    def exit_status(self, job_id: str) -> int | None:
        """The batch script's exit status, from slurmctld's log (no accounting storage here)."""
        for line in open(os.path.join(self.root, "slurmctld.log")):
            if f"_job_complete: JobId={job_id} WEXITSTATUS" in line:
                return int(line.rsplit(None, 1)[-1])
        return None

    def stop(self):
        for job in self.jobs() if self.procs else []:
            self.run("scancel", job, check=False)
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        try:
            with open(os.path.join(self.root, "munged.pid")) as f:
                os.kill(int(f.read().strip()), 15)
        except (OSError, ValueError):
            pass
