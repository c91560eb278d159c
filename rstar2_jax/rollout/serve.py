"""Start a vLLM rollout server for a model directory, with the flags RL training needs.

    python -m rstar2_jax.rollout.serve --model runs/tiny_arith/base_model --port 8100
    python -m rstar2_jax.rollout.serve --model DIR --print_only      # just print the command

Then point training at it: `--config.rollout.engine=vllm --config.rollout.vllm.urls=http://127.0.0.1:8100`
(several URLs go through the KV-aware scheduler). The server runs in vLLM's own venv
(--python, default .venv-vllm/bin/python; docs/ENGINES.md "Rollout server (vLLM)"). It stays in the
foreground until Ctrl-C; its weights are replaced by the trainer's at every sync.

With $RSTAR2_SECRET set, the server and its fetcher answer only requests that carry it (the
trainer's clients send it from their own environment); without it they listen on loopback only.
"""

from __future__ import annotations

import signal
import sys

from absl import app, flags

from rstar2_jax.rollout.engines.vllm_engine.server import (ServerOptions, VLLMServer, default_python, server_command,
                                                    shell_command)
from sandbox.job_secret import SECRET_ENV, OpenServiceError, job_secret

_MODEL = flags.DEFINE_string("model", None, "HF model directory to launch with, or a hub id through the Hugging Face "
                             "cache", required=True)
_HOST = flags.DEFINE_string("host", "127.0.0.1", "address to listen on (0.0.0.0 for other machines)")
_PORT = flags.DEFINE_integer("port", 8100, "port")
_DTYPE = flags.DEFINE_string("dtype", "auto", "float32 | bfloat16 | auto (the checkpoint's)")
_MAX_LEN = flags.DEFINE_integer("max_model_len", 4096, "longest prompt + response, tokens")
_TP = flags.DEFINE_integer("tensor_parallel_size", 1, "GPUs per server")
_GPU_MEM = flags.DEFINE_float("gpu_memory_utilization", None, "share of GPU memory vLLM may take (GPU)")
_CPU_KV = flags.DEFINE_integer("cpu_kv_cache_gib", 4, "KV cache size in whole GiB (CPU build)")
_EAGER = flags.DEFINE_bool("eager", False, "no torch.compile warm-up or CUDA graphs: starts twice as fast on CPU; "
                           "leave off on GPUs")
_LORA_RANK = flags.DEFINE_integer("lora_rank", 0, "serve LoRA adapters up to this rank, loaded by each weight sync "
                                  "(the run's model.lora.rank; 0: no adapters)")
_PYTHON = flags.DEFINE_string("python", None, "the vLLM venv's python (default $RSTAR2_VLLM_PYTHON or .venv-vllm)")
_PRINT_ONLY = flags.DEFINE_bool("print_only", False, "print the command instead of running it")
_EXTRA = flags.DEFINE_multi_string("vllm_arg", [], "extra argument passed to vLLM as is (repeat)")
_FETCH_PORT = flags.DEFINE_integer("fetch_port", None, "also run a weight fetcher on this port (trainers on hosts "
                                   "that share no filesystem with this one: --config.rollout.vllm.sync=pull)")
_FETCH_DIR = flags.DEFINE_string("fetch_dir", None, "where the fetcher keeps pulled weights (default "
                                 "/dev/shm/rstar2_pulled_<fetch_port>: one directory per fetcher on a host)")


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv):
    del argv
    from rstar2_jax.models.hub import ModelNotFound, model_directory
    try:
        model_dir = model_directory(_MODEL.value, "--model")  # a directory, or a hub id through the cache
    except ModelNotFound as e:
        sys.exit(str(e))
    opts = ServerOptions(host=_HOST.value, port=_PORT.value, dtype=_DTYPE.value, max_model_len=_MAX_LEN.value,
                         tensor_parallel_size=_TP.value, gpu_memory_utilization=_GPU_MEM.value,
                         cpu_kv_cache_gib=_CPU_KV.value, eager=_EAGER.value, lora_rank=_LORA_RANK.value,
                         extra_args=tuple(_EXTRA.value))
    python = _PYTHON.value or default_python()
    secret = job_secret()
    argv, env = server_command(model_dir, opts, python, require_secret=bool(secret))
    print(shell_command(argv, env) + (f"   (${SECRET_ENV} from this environment)" if secret else ""), flush=True)
    if _PRINT_ONLY.value:
        return
    server = VLLMServer(model_dir, opts, python=python, secret=secret)
    fetcher = None
    # SIGTERM (scancel, a job's end, kill) stops the server like Ctrl-C: nothing left holding the port
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        if _FETCH_PORT.value is not None:
            from rstar2_jax.rollout.engines.vllm_engine.sync.fetcher import WeightFetcher
            from rstar2_jax.rollout.engines.vllm_engine.sync.fetcher import default_fetch_dir
            fetcher = WeightFetcher(_FETCH_DIR.value or default_fetch_dir(_FETCH_PORT.value), _HOST.value,
                                    _FETCH_PORT.value)
            print(f"weight fetcher: {fetcher.url} (--config.rollout.vllm.fetch_urls={fetcher.url})", flush=True)
        server.start()
        print(f"starting vLLM at {server.url} (about a minute on CPU) ...", flush=True)
        server.wait_ready()
        print(f"ready: {server.url}   train with --config.rollout.engine=vllm "
              f"--config.rollout.vllm.urls={server.url}", flush=True)
        server.proc.wait()
    except KeyboardInterrupt:
        pass
    except OpenServiceError as e:  # beyond loopback without the secret: refused before either one listens
        sys.exit(str(e))
    finally:  # the fetcher first: its copies are memory, and SLURM's SIGKILL may end a slow server.stop()
        if fetcher is not None:
            fetcher.close()
        server.stop()


if __name__ == "__main__":
    app.run(main)
