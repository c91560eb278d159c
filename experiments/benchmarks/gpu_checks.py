"""Correctness of the GPU paths on the GPU: bf16 against fp32, cuDNN and Pallas against XLA.

    python -m experiments.benchmarks.gpu_checks [--model qwen3_0p6b] [--seq 512]

Same random weights throughout; errors are ||a - b|| / ||b|| over the logits (or log-probs).
Expected: bf16 vs fp32 around 1e-2; implementations of the same bf16 function well under that.
The CPU test suite checks the same laws exactly (tests/models/test_attention_impls.py).
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments.benchmarks import common
from rstar2_jax.models import Decoder, init_cache, token_logprobs
from rstar2_jax.models.kv_cache import shuffled_paged_cache


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if not np.isfinite(a).all():
        return float("nan")
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="qwen3_0p6b")
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--layers", type=int, default=0, help="fewer layers than the shape's (quicker to compile)")
    p.add_argument("--decode_only", action="store_true", help="only the decode kernels' checks")
    args = p.parse_args(argv)
    cfg = common.shape(args.model)
    if args.layers:
        cfg = dataclasses.replace(cfg, num_layers=args.layers)
    print(common.device_line(), flush=True)
    fp32 = Decoder(cfg, dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    bf16 = nnx.merge(*nnx.split(Decoder(cfg, dtype=jnp.bfloat16, param_dtype=jnp.float32, rngs=nnx.Rngs(0))))
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (2, args.seq)), jnp.int32)
    results = []
    if not args.decode_only:
        results += _forward_checks(fp32, bf16, tokens)
    results += _decode_checks(cfg, bf16, args.seq)
    print(common.markdown_table(["check", "relative error"],
                                [[n, f"{e:.2e}" if isinstance(e, float) else e] for n, e in results]))


def _forward_checks(fp32, bf16, tokens) -> list:
    """bf16 against fp32, cuDNN against XLA: logits, log-probs and a gradient."""
    fwd = nnx.jit(lambda m, t: m(t))
    lp = nnx.jit(lambda m, t: token_logprobs(m, t))
    results = []
    ref32 = fwd(fp32, tokens)
    ref16 = fwd(bf16, tokens)
    results.append(("bf16 compute vs fp32, logits (XLA attention)", rel(ref16, ref32)))
    grad = nnx.jit(lambda m, t: nnx.grad(lambda mm: token_logprobs(mm, t).sum())(m))
    q_grad = lambda m: grad(m, tokens).layers[0].attn.q_proj[...]
    g_xla = q_grad(bf16)
    try:
        bf16.set_attention(full="cudnn")
        results.append(("cuDNN vs XLA attention, bf16 logits", rel(fwd(bf16, tokens), ref16)))
        results.append(("cuDNN vs XLA attention, grad of log-probs wrt layer-0 q_proj", rel(q_grad(bf16), g_xla)))
    except Exception as e:  # no cuDNN here (a CPU run): say so in the table
        results.append(("cuDNN attention", f"unavailable: {str(e).splitlines()[0][:60]}"))
    bf16.set_attention(full="xla")
    results.append(("bf16 vs fp32 log-probs", rel(lp(bf16, tokens), lp(fp32, tokens))))
    return results


def _decode_checks(cfg, bf16, seq: int) -> list:
    """Pallas's ragged and paged decode kernels against XLA's decode on the same rows."""
    results = []
    # ragged decode: rows at very different lengths, Pallas vs XLA against the same cache
    lengths = np.array([5, seq // 2, seq - 3, 200])
    step = nnx.jit(lambda m, tok, pos, c: m(tok, pos, cache=c))
    rng = np.random.default_rng(2)
    cache = init_cache(cfg, 4, seq + 128, dtype=jnp.bfloat16)
    width = int(lengths.max())
    pos = np.where(np.arange(width)[None] < lengths[:, None], np.arange(width)[None], seq + 128)
    prompt = rng.integers(0, cfg.vocab_size, (4, width))
    _, cache = step(bf16, jnp.asarray(prompt, jnp.int32), jnp.asarray(pos, jnp.int32), cache)
    tok = jnp.asarray(rng.integers(0, cfg.vocab_size, (4, 1)), jnp.int32)
    at = jnp.asarray(lengths[:, None], jnp.int32)
    want, _ = step(bf16, tok, at, jax.tree.map(jnp.copy, cache))
    bf16.set_attention(decode="pallas")
    got, _ = step(bf16, tok, at, jax.tree.map(jnp.copy, cache))
    results.append(("Pallas ragged vs XLA decode, bf16 logits", rel(got, want)))

    # paged decode: the same rows through a shuffled page table (pages of 16), Pallas's paged
    # kernel against XLA's gather of the pages, and against the contiguous rows above
    paged = shuffled_paged_cache(cfg, np.asarray(lengths) + 1, 16, max_len=seq + 128, dtype=jnp.bfloat16)
    bf16.set_attention(decode="xla")
    _, paged = step(bf16, jnp.asarray(prompt, jnp.int32), jnp.asarray(pos, jnp.int32), paged)
    want_paged, _ = step(bf16, tok, at, jax.tree.map(jnp.copy, paged))
    results.append(("XLA paged vs XLA rows decode, bf16 logits", rel(want_paged, want)))
    bf16.set_attention(decode="pallas")
    try:
        got_paged, _ = step(bf16, tok, at, jax.tree.map(jnp.copy, paged))
        results.append(("Pallas paged vs XLA paged decode, bf16 logits", rel(got_paged, want_paged)))
    except Exception as e:  # noqa: BLE001 - a kernel that cannot run here is the result
        results.append(("Pallas paged decode", f"failed: {type(e).__name__}: {str(e).splitlines()[0][:80]}"))
    bf16.set_attention(decode="xla")
    return results


if __name__ == "__main__":
    main()
