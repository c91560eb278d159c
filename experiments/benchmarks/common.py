"""Shared pieces of the GPU benchmarks: model shapes, the two hardware ceilings, recording.

Every benchmark measures the ceilings it divides by in the same run (a large device copy and a
large bf16 matmul), because these machines are shared and datasheet figures are only leads.
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from rstar2_jax.models import ModelConfig, RopeConfig

H100_DENSE_BF16 = 989e12  # FLOP/s, datasheet (SXM, dense)

# Shapes of public checkpoints (random weights: no downloads here).
SHAPES = {
    "qwen3_0p6b": dict(family="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_layers=28,
                       num_heads=16, num_kv_heads=8, head_dim=128, qk_norm=True, tie_word_embeddings=True,
                       rope=RopeConfig(theta=1e6)),
    "qwen3_1p7b": dict(family="qwen3", vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_layers=28,
                       num_heads=16, num_kv_heads=8, head_dim=128, qk_norm=True, tie_word_embeddings=True,
                       rope=RopeConfig(theta=1e6)),
    # for trying the scripts on a CPU
    "tiny": dict(family="qwen3", vocab_size=512, hidden_size=128, intermediate_size=384, num_layers=2,
                 num_heads=4, num_kv_heads=2, head_dim=32, qk_norm=True, tie_word_embeddings=True),
}


def shape(name: str) -> ModelConfig:
    if name not in SHAPES:
        raise SystemExit(f"unknown model shape {name!r}; known: {sorted(SHAPES)}")
    return ModelConfig(**SHAPES[name])


def enable_compile_cache(path: str = ".jax_cache"):
    """Reuse compiled programs across runs on a warm machine (the directory is gitignored)."""
    jax.config.update("jax_compilation_cache_dir", os.path.abspath(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)


def device_line() -> str:
    d = jax.devices()[0]
    return f"{d.device_kind} ({d.platform}), jax {jax.__version__}, {platform.python_version()}"


def median_seconds(fn, *, repeats: int, warmup: int = 1) -> float:
    """Median wall time of fn() (which must block until its device work is done)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def copy_bandwidth(gib: float = 2.0) -> float:
    """Device memory bandwidth in bytes/s: x + 1 over a large float32 array (read + write)."""
    n = int(gib * 2 ** 30 / 4)
    x = jax.random.normal(jax.random.key(0), (n,), jnp.float32)
    add = jax.jit(lambda a: a + 1.0)
    t = median_seconds(lambda: add(x).block_until_ready(), repeats=10, warmup=2)
    return 2 * 4 * n / t


def matmul_rate(n: int = 8192) -> float:
    """bf16 matmul FLOP/s on random data (the measured compute ceiling)."""
    k1, k2 = jax.random.split(jax.random.key(1))
    a = jax.random.normal(k1, (n, n), jnp.bfloat16)
    b = jax.random.normal(k2, (n, n), jnp.bfloat16)
    mm = jax.jit(lambda x, y: x @ y)
    t = median_seconds(lambda: mm(a, b).block_until_ready(), repeats=20, warmup=3)
    return 2 * n ** 3 / t


def markdown_table(header: list[str], rows: list[list]) -> str:
    fmt = lambda v: f"{v:.3g}" if isinstance(v, float) else str(v)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def command_line(module: str, argv) -> str:
    """How a benchmark was invoked, for its record: `python -m MODULE ARGS`."""
    args = sys.argv[1:] if argv is None else list(argv)
    return " ".join(["python -m", module, *args])


def record(path: str | None, title: str, command: str, config: str, table: str, notes: str = ""):
    """Append one result block (device, date, config, command, table) to a BENCHMARKS.md."""
    block = (f"\n## {title}\n\n- Device: {device_line()}. Date: {datetime.date.today().isoformat()}.\n"
             f"- Config: {config}\n- Command: `{command}`\n\n{table}\n" + (f"\n{notes}\n" if notes else ""))
    print(block)
    if path:
        with open(path, "a") as f:
            f.write(block)
