"""experiments.benchmarks.decode_matmuls: the compiled program's matmuls and concatenates are
counted once each, whether XLA runs them as dots, cuBLAS calls or gemm fusions (issue 70: does XLA
already merge a layer's projections on a GPU?)."""

import jax
import jax.numpy as jnp

from experiments.benchmarks import common, decode_matmuls

# The shape of a GPU compile's text (XLA 0.11): a Triton gemm fusion, a cuBLAS call, and a
# concatenate fusion, inside a while body; the fused computations' own dots are not runs of their own.
_GPU_TEXT = """HloModule jit_run

%gemm_fusion_dot.1_computation (p0: bf16[128,64], p1: bf16[64,96]) -> bf16[128,96] {
  %p0 = bf16[128,64]{1,0} parameter(0)
  %p1 = bf16[64,96]{1,0} parameter(1)
  ROOT %dot.3 = bf16[128,96]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_concatenate (p0: bf16[64,32], p1: bf16[64,64]) -> bf16[64,96] {
  %p0 = bf16[64,32]{1,0} parameter(0)
  %p1 = bf16[64,64]{1,0} parameter(1)
  ROOT %concatenate.1 = bf16[64,96]{1,0} concatenate(%p0, %p1), dimensions={1}
}

%body (arg: (s32[], bf16[128,64])) -> (s32[], bf16[128,64]) {
  %arg = (s32[], bf16[128,64]) parameter(0)
  %w = bf16[64,96]{1,0} fusion(%a, %b), kind=kLoop, calls=%fused_concatenate
  %gemm_fusion_dot.1 = bf16[128,96]{1,0} fusion(%x, %w), kind=kCustom, calls=%gemm_fusion_dot.1_computation, \
backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}
  %cublas-gemm.2 = (bf16[128,64]{1,0}, s8[0]{0}) custom-call(%y, %z), custom_call_target="__cublas$gemm"
  ROOT %t = (s32[], bf16[128,64]) tuple(%i, %y)
}

ENTRY %main (x: bf16[128,64]) -> bf16[128,64] {
  %x = bf16[128,64]{1,0} parameter(0)
  ROOT %while = (s32[], bf16[128,64]) while(%init), condition=%cond, body=%body
}
"""


def test_each_matmul_and_concatenate_counts_once_as_dot_gemm_fusion_or_cublas_call():
    assert decode_matmuls.compiled_counts(_GPU_TEXT) == (2, 1)


def test_the_cpu_compile_counts_seven_projections_a_layer_as_written_and_four_merged():
    cfg = common.shape("tiny")
    counts = {}
    for merged in (False, True):
        layers = [decode_matmuls.layer_weights(cfg, jax.random.key(i), merged)
                  for i in range(cfg.num_layers)]
        x = jnp.ones((8, cfg.hidden_size), jnp.bfloat16)
        text = decode_matmuls.chunk_fn(cfg, merged, steps=2).lower(x, layers).compile().as_text()
        counts[merged] = decode_matmuls.compiled_counts(text)[0]
    assert counts == {False: 7 * cfg.num_layers, True: 4 * cfg.num_layers}, counts
