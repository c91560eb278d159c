"""Run a test module's main() in a subprocess with 8 fake CPU devices and collect its JSON lines.
(XLA_FLAGS must be set before jax is imported, hence the subprocess.)"""

import json
import os
import subprocess
import sys

from tests.xla_flags import xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_on_8_fake_devices(module: str, timeout: int = 900) -> list[dict]:
    env = dict(os.environ, XLA_FLAGS=xla_flags("--xla_force_host_platform_device_count=8"), JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-m", module], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def run_as_processes(module: str, n: int = 2, devices_per_process: int = 2, timeout: int = 600) -> list[dict]:
    """Run `module` as n JAX processes of one job (`python -m module PROCESS_ID PORT`: it calls
    jax.distributed.initialize on a loopback coordinator), each with `devices_per_process` fake
    CPU devices; the JSON lines of all of them. Output goes to files, not pipes: a process
    blocked on a full pipe would stall the others in a collective."""
    import tempfile

    from rstar2_jax.rollout.engines.vllm_engine.server import free_port

    env = dict(os.environ, XLA_FLAGS=xla_flags(f"--xla_force_host_platform_device_count={devices_per_process}"),
               JAX_PLATFORMS="cpu")
    port = free_port()
    outs = [tempfile.TemporaryFile("w+") for _ in range(n)]
    procs = [subprocess.Popen([sys.executable, "-m", module, str(i), str(port)], cwd=ROOT, env=env, stdout=out,
                              stderr=subprocess.STDOUT, text=True) for i, out in enumerate(outs)]
    try:
        codes = [p.wait(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    texts = []
    for out in outs:
        with out:
            out.seek(0)
            texts.append(out.read())
    assert codes == [0] * n, [t[-3000:] for t in texts]
    return [json.loads(line) for t in texts for line in t.splitlines() if line.startswith("{")]
