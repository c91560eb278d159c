#!/usr/bin/env bash
# Issue 70's device checks in one lease (about 9 minutes on one H200), most important first; each
# step has its own time limit and writes its log under $OUT as it goes, so a lease cut short keeps
# what ran. Run from the repository root on the device machine, with the ml_collections wheel
# carried in .whl (the image has everything else):
#   carry [".whl"]; command: bash experiments/benchmarks/h200_issue70.sh
# 1. decode against the roofline, Qwen3-0.6B at 256 and 128 slots, one step per dispatch against 16;
# 2. a profile of 127 steps at 128 slots, 16 steps per dispatch (its own process: the 2026-12-04
#    lease showed the profile does not fit beside step 1 in one limit);
# 3. decode at Qwen3-1.7B, 16 steps per dispatch;
# 4. learner MFU with model.remat=dots_attention (packed rows, Qwen3-1.7B; 140 s was too short);
# 5. paged KV under chunks (pages of 256), not yet measured.
# The command-buffer settings were measured on 2026-12-04 (within 4% of XLA's defaults) and dropped
# from the script; BENCHMARKS.md, "JaxEngine decode on an H200", has them.
# A CPU rehearsal of the script's plumbing: REHEARSE=1 bash experiments/benchmarks/h200_issue70.sh
# (tiny model, XLA attention, short runs).
set -u
if [ "${REHEARSE:-}" = 1 ]; then
  S=tiny; L=tiny; A=xla; N=64; MFU_ARGS="--attention xla --rollouts 8 --steps 1"; PY=.venv/bin/python
else
  S=qwen3_0p6b; L=qwen3_1p7b; A=pallas; N=1024; MFU_ARGS="--rollouts 64 --steps 2"; PY=python3
fi
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ "${REHEARSE:-}" != 1 ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD || exit 1
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
fi
export PYTHONUNBUFFERED=1
step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  echo "== $name (limit ${limit}s) $(date +%T)"
  SECONDS=0
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "rc=$? in ${SECONDS}s" | tee -a "$OUT/$name.log"
  grep -iE "tok/s|roofline|mfu|profiled|busy|sampling pass|failed|error" "$OUT/$name.log" | tail -12
}
D=experiments.benchmarks.engine_decode
step decode_0p6b 160 $PY -m $D --model $S --slots 256,128 --prompt 256 --new $N \
  --variants $A:full --decode_steps 1,16
step profile_0p6b 80 $PY -m $D --model $S --slots 128 --prompt 256 --new 128 \
  --variants $A:full --decode_steps 16 --profile /tmp/trace_0p6b
step decode_1p7b 120 $PY -m $D --model $L --slots 128,256 --prompt 256 --new $((N / 2)) \
  --variants $A:full --decode_steps 16
step mfu_dots_attention 180 $PY -m experiments.benchmarks.packing gpu --skip_checks --model $L $MFU_ARGS \
  --variants packed:32768:dots_attention
step paged_0p6b 55 $PY -m $D --model $S --slots 128 --prompt 256 --new $N \
  --variants $A:paged256 --decode_steps 16
echo "== done $(date +%T)"
