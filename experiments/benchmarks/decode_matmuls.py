"""A decode step's weight matmuls alone: as the model writes them (q, k, v, o, gate, up, down: seven
per layer) against pre-merged (qkv, o, gate_up, down: four), inside a loop of decode steps.

    python -m experiments.benchmarks.decode_matmuls --model qwen3_0p6b --rows 128,256 [--steps 16]

Why: at 128 slots the JaxEngine's decode step on an H200 spends about 2 ms on work that does not
grow with the KV (BENCHMARKS.md, "JaxEngine decode on an H200": 6.13 ms at 128 slots against 10.22
at 256, KV floors 3.6 and 7.3 ms), against 0.38 ms to read the weights; the profile's top ops after
the attention kernel are the layers' matmul fusions. With few rows a matmul is short, and what
each costs beyond its bytes (a launch, a ramp, few output tiles to spread over the SMs) counts
per matmul, so fewer, wider ones may win. XLA may already merge matmuls that share an operand
(its DotMerger pass, on GPUs), concatenating the weights: the compiled loop's matmuls and
concatenates are counted, so the table says whether it did, and whether that concatenate runs
every step (inside the loop) or once.

Each step is every layer's projections on [rows, hidden] bf16 activations (the attention itself
replaced by its query, so that o_proj reads a value of the right shape; k and v are returned, as
the KV scatter consumes them), the weights loop-invariant, as in the engine's chunk. Roofline: the
layers' weight bytes over the copy bandwidth measured in the same run. If pre-merged wins, the
engine's weights are the thing to merge (at each landing, once); if not, this lever is closed.
"""

from __future__ import annotations

import argparse
import re
import sys

import jax
import jax.numpy as jnp

from experiments.benchmarks import common
from rstar2_jax.models import flops


def layer_weights(cfg, key, merged: bool, dtype=jnp.bfloat16):
    e, h, kv, d, m = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    ks = jax.random.split(key, 7)
    w = lambda k, shape: (jax.random.normal(k, shape, jnp.float32) * 0.02).astype(dtype)
    q, k, v = w(ks[0], (e, h * d)), w(ks[1], (e, kv * d)), w(ks[2], (e, kv * d))
    gate, up = w(ks[4], (e, m)), w(ks[5], (e, m))
    o, down = w(ks[3], (h * d, e)), w(ks[6], (m, e))
    if merged:
        return {"qkv": jnp.concatenate([q, k, v], axis=1), "o": o, "gate_up": jnp.concatenate([gate, up], axis=1),
                "down": down}
    return {"q": q, "k": k, "v": v, "o": o, "gate": gate, "up": up, "down": down}


def decode_layers(cfg, merged: bool):
    """One decode step's projections over every layer: x [rows, hidden] -> (x, k and v per layer)."""
    hd, kvd, m = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size

    def step(x, layers):
        kvs = []
        for w in layers:
            if merged:
                qkv = x @ w["qkv"]
                q, k, v = qkv[:, :hd], qkv[:, hd:hd + kvd], qkv[:, hd + kvd:]
            else:
                q, k, v = x @ w["q"], x @ w["k"], x @ w["v"]
            kvs.append((k, v))
            x = x + q @ w["o"]
            if merged:
                gu = x @ w["gate_up"]
                gate, up = gu[:, :m], gu[:, m:]
            else:
                gate, up = x @ w["gate"], x @ w["up"]
            x = x + (jax.nn.silu(gate) * up) @ w["down"]
        return x, kvs

    return step


def chunk_fn(cfg, merged: bool, steps: int):
    """`steps` decode steps in a loop of a known count, the weights loop-invariant (as the engine's
    chunk); the KV of each step summed into one buffer so nothing is dead code."""
    step = decode_layers(cfg, merged)

    def run(x, layers):
        def body(_, carry):
            x, acc = carry
            x, kvs = step(x, layers)
            x = x / (1 + jnp.abs(x).max())  # keep the values finite over the steps
            return x, acc + sum(k.sum() + v.sum() for k, v in kvs).astype(jnp.float32)

        return jax.lax.fori_loop(0, steps, body, (x, jnp.float32(0)))

    return jax.jit(run)


_CALLS = re.compile(r"\bcalls=%?([\w.\-]+)")


def _computations(text: str) -> dict[str, list[str]]:
    """The compiled module's computations by name, each its instruction lines."""
    out: dict[str, list[str]] = {}
    name = None
    for line in text.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            name = line.split()[1 if line.startswith("ENTRY") else 0].lstrip("%")
            out[name] = []
        elif line.startswith("}"):
            name = None
        elif name is not None and " = " in line:
            out[name].append(line)
    return out


def compiled_counts(compiled_text: str) -> tuple[int, int]:
    """(matmuls, concatenates) the compiled program runs, loop bodies included: a gemm custom call
    (cuBLAS) or a dot is one, and so is a fusion whose computation holds one (a Triton gemm
    fusion, an XLA dot fusion); instructions inside fusions are not counted again."""
    comps = _computations(compiled_text)
    fused = {m.group(1) for lines in comps.values() for line in lines if " fusion(" in line
             for m in [_CALLS.search(line)] if m}

    def holds(body: str, op: str) -> bool:
        return any(f" {op}(" in line for line in comps.get(body, ()))

    matmuls = concats = 0
    for name, lines in comps.items():
        if name in fused:
            continue
        for line in lines:
            call = _CALLS.search(line)
            body = call.group(1) if call and " fusion(" in line else None
            if " dot(" in line or ("custom-call(" in line and ("gemm" in line or "cublas" in line)) \
                    or (body and holds(body, "dot")):
                matmuls += 1
            if " concatenate(" in line or (body and holds(body, "concatenate")):
                concats += 1
    return matmuls, concats


def measure(cfg, rows: int, steps: int, merged: bool, repeats: int) -> tuple[float, int, int]:
    layers = [layer_weights(cfg, jax.random.key(i), merged) for i in range(cfg.num_layers)]
    x = jax.random.normal(jax.random.key(99), (rows, cfg.hidden_size), jnp.float32).astype(jnp.bfloat16)
    fn = chunk_fn(cfg, merged, steps)
    matmuls, concats = compiled_counts(fn.lower(x, layers).compile().as_text())
    seconds = common.median_seconds(lambda: jax.block_until_ready(fn(x, layers)), repeats=repeats)
    return seconds / steps * 1e3, matmuls, concats


def weight_bytes(cfg, dtype_bytes: int = 2) -> int:
    """The layers' projection weights (the matmul parameters without the LM head), in bytes."""
    return dtype_bytes * (flops.matmul_params(cfg) - cfg.hidden_size * cfg.vocab_size)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3_0p6b")
    p.add_argument("--rows", default="128,256", help="decode rows (the engine's slots)")
    p.add_argument("--steps", type=int, default=16, help="decode steps per loop (the engine's chunk)")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--record", help="append the result block to this markdown file")
    args = p.parse_args(argv)
    common.enable_compile_cache()
    cfg = common.shape(args.model)
    bw = common.copy_bandwidth()
    floor_ms = weight_bytes(cfg) / bw * 1e3
    print(f"{args.model}: {cfg.num_layers} layers; {common.device_line()}; copy bandwidth {bw / 1e12:.2f} TB/s; "
          f"the layers' weights {weight_bytes(cfg) / 1e9:.2f} GB = {floor_ms:.3f} ms a step at that rate", flush=True)
    rows = []
    for n in (int(r) for r in args.rows.split(",")):
        results = {}
        for merged in (False, True):  # side by side, in one process
            results[merged] = measure(cfg, n, args.steps, merged, args.repeats)
            ms, matmuls, concats = results[merged]
            name = "pre-merged (4 a layer)" if merged else "as written (7 a layer)"
            rows.append([n, name, f"{ms:.3f}", f"{floor_ms / ms:.0%}", matmuls, concats])
            print(f"{n} rows, {name}: {ms:.3f} ms a step ({floor_ms / ms:.0%} of the weights' floor); "
                  f"compiled: {matmuls} matmuls, {concats} concatenates", flush=True)
        print(f"{n} rows: pre-merged / as written = {results[True][0] / results[False][0]:.2f}x the time", flush=True)
    table = common.markdown_table(["rows", "projections", "ms a step", "of the weights' floor", "compiled matmuls",
                                   "compiled concatenates"], rows)
    common.record(args.record, f"Decode matmuls: {args.model}, as written against pre-merged",
                  "python -m experiments.benchmarks.decode_matmuls " + " ".join(argv if argv is not None else sys.argv[1:]),
                  f"{args.model} layer shapes, random bf16 weights, {args.steps} steps in a loop of a known count, "
                  f"the projections only (no attention); copy bandwidth {bw / 1e12:.2f} TB/s", table,
                  group=common.ENGINES)


if __name__ == "__main__":
    main()
