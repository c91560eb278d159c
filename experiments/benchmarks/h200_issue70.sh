#!/usr/bin/env bash
# Issue 70's device checks in one lease, most important first. The limits add up to about 16
# minutes, more than a lease's 15 of device time and a call's 10 (two calls: FROM below). Each
# step has its own time limit and writes its log under $OUT as it
# goes, so a lease cut short keeps what ran. Run from the repository root on the device machine,
# with the wheels the image lacks carried in .whl (ml-collections; math-verify and its two for the
# RL step's grader), made with
#   pip download --no-deps -d .whl ml-collections==1.1.0 math-verify==0.9.0 \
#     latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2
#   carry [".whl"]; command: bash experiments/benchmarks/h200_issue70.sh
# 0. (issue 81, first) the learner's update in one pass against the step plus the separate
#    old-log-prob pass, MFU and time, Qwen3-0.6B and Qwen3-1.7B (experiments/benchmarks/learner_mfu.py);
# 1. decode against the roofline, Qwen3-0.6B at 128 and 256 slots, chunks of 16 and 64 steps, each
#    with the check for a live slot every step (today's default) against once a chunk (a loop of a
#    count XLA knows: no device-to-host wait per step; rollout.jax.exit_check_steps). Does either
#    reach 70% at 128 slots (65.6% on 2026-12-04)?
# 2. a whole colocated RL step on the GPU (experiments/benchmarks/rl_step.py: the demo's recipe on
#    the Qwen3-0.6B shape, SFT warm start, 3 GRPO-RoC steps, live sandbox calls, packed update),
#    each phase's time and share against the pipeline model's prediction;
# 3. a decode step's weight matmuls alone, as the model writes them (7 a layer) against pre-merged
#    (qkv and gate_up: 4), and whether XLA already merged them (experiments/benchmarks/decode_matmuls.py):
#    at 128 slots about 2 ms of each step does not grow with the KV, against 0.38 ms of weights;
# 4. step 1's two loops at 128 slots with XLA's command buffers capturing loops (+WHILE,+CONDITIONAL): on
#    2026-12-04 they gave nothing, with the loop's count unknown; a known count lets XLA put the
#    whole chunk in one CUDA graph;
# 5. a profile of 127 steps at 128 slots, 16 steps per dispatch, the whole-chunk loop (its own
#    process: the 2026-12-04 lease showed the profile does not fit beside step 1 in one limit): the
#    device's busy share from the first decode kernel on, and kernels a step by family;
# 6. paged KV under chunks (pages of 256), not yet measured;
# 7. decode at Qwen3-1.7B, 16 steps per dispatch, both exit checks;
# 8. learner MFU with model.remat=dots_attention (measured 2026-12-04: 46.6%; last, as a re-check).
# The other command-buffer settings were measured on 2026-12-04 (within 4% of XLA's defaults);
# BENCHMARKS.md, "JaxEngine decode on an H200", has them.
# A CPU rehearsal of the script's plumbing: REHEARSE=1 bash experiments/benchmarks/h200_issue70.sh
# (tiny model, XLA attention, short runs).
set -u
if [ "${REHEARSE:-}" = 1 ]; then
  S=tiny; L=tiny; A=xla; N=64; LM="--model qwen3_0p6b --seq 128 --variants xla:full:1 --steps 1"; LM_BIG=$LM; P=paged64; MFU_ARGS="--attention xla --rollouts 8 --steps 1"; PY=.venv/bin/python
  STEP_ARGS="--dtype float32 --sft_steps 40 --steps 2 --slots 32 --token_budget 2048"
else
  S=qwen3_0p6b; L=qwen3_1p7b; A=pallas; N=1024; LM="--model $S --seq 4096 --variants cudnn:dots:8 --steps 3"
  LM_BIG="--model $L --seq 4096 --variants cudnn:dots:4 --steps 3"; P=paged256; MFU_ARGS="--rollouts 64 --steps 2"; PY=python3
  STEP_ARGS="--sft_lr 5e-4"
fi
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ "${REHEARSE:-}" != 1 ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD || exit 1
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
fi
export PYTHONUNBUFFERED=1
# One call may run 600 s and the limits add up to more: a second call runs the rest from the first
# step the first did not finish, FROM=NAME (the lease keeps the compile cache, .jax_cache, between).
FROM=${FROM:-}
step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  if [ -n "$FROM" ] && [ "$name" != "$FROM" ]; then echo "== $name: skipped (FROM=$FROM)"; return; fi
  FROM=
  echo "== $name (limit ${limit}s) $(date +%T)"
  SECONDS=0
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "rc=$? in ${SECONDS}s" | tee -a "$OUT/$name.log"
  grep -iE "tok/s|roofline|floor|the time|mfu|profiled|busy|kernels a step|sampling pass|failed|error" "$OUT/$name.log" | tail -12
}
D=experiments.benchmarks.engine_decode
step learner_one_pass_0p6b 150 $PY -m experiments.benchmarks.learner_mfu $LM
step learner_one_pass_1p7b 150 $PY -m experiments.benchmarks.learner_mfu $LM_BIG
step decode_0p6b 260 $PY -m $D --model $S --slots 128,256 --prompt 256 --new $N \
  --variants $A:full --decode_steps 16,64 --exit_check 1,all
step rl_step_0p6b 240 $PY -m experiments.benchmarks.rl_step --shape $S --decode_attention $A $STEP_ARGS \
  --workdir /tmp/rl_step
step matmuls_0p6b 60 $PY -m experiments.benchmarks.decode_matmuls --model $S --rows 128,256
step graphs_0p6b 70 env XLA_FLAGS=--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL $PY -m $D --model $S \
  --slots 128 --prompt 256 --new $N --variants $A:full --decode_steps 16 --exit_check 1,all
step profile_0p6b 80 $PY -m $D --model $S --slots 128 --prompt 256 --new 128 \
  --variants $A:full --decode_steps 16 --exit_check all --profile /tmp/trace_0p6b
step paged_0p6b 55 $PY -m $D --model $S --slots 128 --prompt 256 --new $N \
  --variants $A:$P --decode_steps 16
step decode_1p7b 200 $PY -m $D --model $L --slots 128,256 --prompt 256 --new $((N / 2)) \
  --variants $A:full --decode_steps 16 --exit_check 1,all
step mfu_dots_attention 180 $PY -m experiments.benchmarks.packing gpu --skip_checks --model $L $MFU_ARGS \
  --variants packed:32768:dots_attention
echo "== done $(date +%T)"
