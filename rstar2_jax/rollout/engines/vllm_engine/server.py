"""Start, watch and stop a vLLM OpenAI-compatible server (a separate process, in its own venv).

    server = VLLMServer(model_dir, port=8100, python=".venv-vllm/bin/python")
    server.start(); server.wait_ready()   # ... server.url ...; server.stop()

vLLM lives in its own virtual environment (it pins its own torch), so the server is always a
subprocess started with that venv's python; this module only builds the command and manages the
process. The flags that matter for RL (see shared notes on vLLM):
- VLLM_SERVER_DEV_MODE=1 enables /pause, /resume, /collective_rpc (reload_weights),
  /reset_prefix_cache and /update_weight_version, which the weight sync calls;
- --logprobs-mode processed_logprobs returns log-probs at the sampling temperature (before
  top-k/top-p), the distribution the learner recomputes; the default is the raw (T = 1) one;
- on CPU: VLLM_CPU_KVCACHE_SPACE (GiB of KV cache) and VLLM_CPU_OMP_THREADS_BIND=nobind.

Where the job has a secret ($RSTAR2_SECRET, sandbox/job_secret.py) the server answers only
requests that carry it (vllm_engine/plugins/rstar2_vllm_auth.py, loaded by vLLM's --middleware): the
dev-mode routes above would otherwise let anyone who reaches it swap the policy's weights. The
secret reaches the server through its environment, never its command line.
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request

from sandbox.job_secret import SECRET_ENV, bearer_headers, check_open_service, job_secret

# the middleware's directory (stdlib only, so the vLLM venv can import it without this package)
AUTH_PLUGIN_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "plugins")
AUTH_MIDDLEWARE = "rstar2_vllm_auth.RequireSecret"

# LoRA adapter versions a server holds at once (the newest and the ones before it): the sync
# unloads older ones (adapter_sync.KEEP)
ADAPTERS_KEPT = 3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_python() -> str:
    """The vLLM venv's interpreter: $RSTAR2_VLLM_PYTHON, else .venv-vllm/bin/python under the cwd."""
    return os.environ.get("RSTAR2_VLLM_PYTHON") or os.path.join(".venv-vllm", "bin", "python")


@dataclasses.dataclass
class ServerOptions:
    host: str = "127.0.0.1"
    port: int = 8100
    dtype: str = "auto"               # float32 for exact parity tests, bfloat16 on GPUs
    max_model_len: int = 4096
    served_model_name: str | None = None  # default: the model directory
    gpu_memory_utilization: float | None = None
    tensor_parallel_size: int = 1
    seed: int = 0
    cpu_kv_cache_gib: int = 1         # VLLM_CPU_KVCACHE_SPACE, whole GiB (CPU build only)
    # No torch.compile warm-up or CUDA graphs, and (one device) the worker inside the engine's
    # process: on CPU the tiny test model's server is ready in ~30 s instead of ~55 s and decodes as
    # fast (BENCHMARKS.md, "vLLM server start-up"). A CPU quick start: leave it off on GPUs.
    eager: bool = False
    # LoRA runs (model.lora.rank > 0): serve adapters up to this rank, loaded at run time by each
    # sync (vllm_engine/sync/adapters.py); KEEP versions may be loaded at once. 0: no adapters.
    lora_rank: int = 0
    extra_args: tuple[str, ...] = ()


def server_command(model_dir: str, opts: ServerOptions, python: str | None = None, *,
                   require_secret: bool = False) -> tuple[list[str], dict[str, str]]:
    """(argv, extra environment) that start a vLLM server for `model_dir` with the RL routes on.
    require_secret: every route needs $RSTAR2_SECRET, which the server then needs in its own
    environment (not in what this returns: the command is printed)."""
    argv = [python or default_python(), "-m", "vllm.entrypoints.openai.api_server",
            "--model", os.path.abspath(model_dir), "--host", opts.host, "--port", str(opts.port),
            "--dtype", opts.dtype, "--max-model-len", str(opts.max_model_len), "--seed", str(opts.seed),
            "--logprobs-mode", "processed_logprobs", "--tensor-parallel-size", str(opts.tensor_parallel_size),
            # each response's usage then says how many prompt tokens the prefix cache held: the
            # prefix-cache hit rate of one RL step's own requests (engines/accounting.py)
            "--enable-prompt-tokens-details"]
    if opts.served_model_name:
        argv += ["--served-model-name", opts.served_model_name]
    if opts.gpu_memory_utilization is not None:
        argv += ["--gpu-memory-utilization", str(opts.gpu_memory_utilization)]
    env = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": str(int(opts.cpu_kv_cache_gib)),
           "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    if opts.eager:
        argv += ["--enforce-eager"]
        if opts.tensor_parallel_size == 1:  # vLLM's CPU platform takes "uni" only with this variable
            argv += ["--distributed-executor-backend", "uni"]         # (vllm/platforms/cpu.py)
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if opts.lora_rank:
        argv += ["--enable-lora", "--max-lora-rank", str(_served_rank(opts.lora_rank)), "--max-loras",
                 str(ADAPTERS_KEPT), "--max-cpu-loras", str(ADAPTERS_KEPT)]
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    if require_secret:
        argv += ["--middleware", AUTH_MIDDLEWARE]
        env["PYTHONPATH"] = os.pathsep.join(p for p in (AUTH_PLUGIN_DIR, os.environ.get("PYTHONPATH", "")) if p)
    argv += list(opts.extra_args)
    return argv, env


def _served_rank(rank: int) -> int:
    """vLLM takes --max-lora-rank from a fixed list (1, 8, 16, 32, 64, 128, 256, 320, 512 in 0.32):
    the smallest that holds `rank`."""
    for allowed in (1, 8, 16, 32, 64, 128, 256, 320, 512):
        if rank <= allowed:
            return allowed
    raise ValueError(f"vLLM serves LoRA adapters up to rank 512, not {rank}")


def shell_command(argv: list[str], env: dict[str, str]) -> str:
    return " ".join([f"{k}={shlex.quote(v)}" for k, v in env.items()] + [shlex.quote(a) for a in argv])


class ServerStartError(RuntimeError):
    pass


class VLLMServer:
    """One vLLM server process. `restart()` keeps the URL (same port), as a supervisor would."""

    def __init__(self, model_dir: str, opts: ServerOptions | None = None, *, python: str | None = None,
                 log_path: str | None = None, secret: str | None = None):
        """secret: what every request must carry (default $RSTAR2_SECRET; None there: open, which
        only loopback allows)."""
        self.model_dir = os.path.abspath(model_dir)
        self.opts = opts or ServerOptions()
        self.python = python or default_python()
        self.log_path = log_path
        self.secret = secret or job_secret()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{self.opts.host}:{self.opts.port}"

    @property
    def model_name(self) -> str:
        return self.opts.served_model_name or self.model_dir

    def start(self) -> "VLLMServer":
        if not os.path.exists(self.python):
            raise ServerStartError(f"no vLLM interpreter at {self.python}: create the venv (`make .venv-vllm/.installed`, "
                                   "docs/ENGINES.md 'Rollout server (vLLM)') or pass python=")
        check_open_service("the vLLM server", self.opts.host, self.secret)
        argv, env = server_command(self.model_dir, self.opts, self.python, require_secret=bool(self.secret))
        if self.secret:
            env[SECRET_ENV] = self.secret
        log = open(self.log_path, "ab") if self.log_path else None  # None: the server prints to our stdout
        # its own process group, so stop() also ends the engine-core child process
        self.proc = subprocess.Popen(argv, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        if log is not None:
            log.close()
        return self

    def wait_ready(self, timeout: float = 600.0) -> "VLLMServer":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise ServerStartError(f"vLLM server exited with code {self.proc.returncode} while starting"
                                       + (f"; log: {self.log_path}\n{_tail(self.log_path)}" if self.log_path else ""))
            if is_ready(self.url, self.secret):
                return self
            time.sleep(1.0)
        raise ServerStartError(f"vLLM server at {self.url} not ready after {timeout:.0f} s"
                               + (f"; log: {self.log_path}\n{_tail(self.log_path)}" if self.log_path else ""))

    def kill(self):
        """SIGKILL the whole process group: what a crash looks like to clients."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self, timeout: float = 30.0):
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()

    def restart(self, timeout: float = 600.0) -> "VLLMServer":
        self.stop()
        return self.start().wait_ready(timeout)

    def __enter__(self):
        return self.start().wait_ready()

    def __exit__(self, *exc):
        self.stop()


def is_ready(url: str, secret: str | None = None) -> bool:
    """The server answers /v1/models with its model (what a restarted server does once loaded).
    secret: what to show it (default $RSTAR2_SECRET)."""
    request = urllib.request.Request(url + "/v1/models", headers=bearer_headers(secret or job_secret()))
    try:
        with urllib.request.urlopen(request, timeout=2.0) as r:
            return r.status == 200 and bool(json.load(r).get("data"))
    except (OSError, ValueError, http.client.HTTPException):
        return False


def _tail(path: str, n: int = 30) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return ""


if __name__ == "__main__":  # pragma: no cover - see rstar2_jax.rollout.serve
    sys.exit("use: python -m rstar2_jax.rollout.serve --model DIR")
