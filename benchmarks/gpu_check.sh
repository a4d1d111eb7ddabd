#!/usr/bin/env bash
# The checks that need a CUDA machine (CI has none), in one short run:
#   1. the single-process layer tests on the GPU (the layer against the reference, forward
#      and backward; tests/conftest.py's EPSCALE_TEST_DEVICE; the CPU kernels' tests under
#      tests/kernels/ are CPU-only and not run);
#   2. a short training run on the GPU, then a resume from its checkpoint;
#   3. benchmarks/moe_layer.py on the GPU (synchronised timing; on CUDA the layer runs
#      moe.experts_impl=grouped_mm), benchmarks/profile_layer.py (launches, host syncs, top
#      kernels per step) and the layer against a carried base revision
#      (benchmarks/ab_revisions.py, when .base exists);
#   4. FSDP on one GPU: a short bf16 run with parallel.fsdp and full recomputation, then a
#      resume; benchmarks/memory.py --device cuda (the activation estimate against
#      torch.cuda.memory_allocated in bf16, each recomputation mode);
#   5. with >= 2 GPUs, benchmarks/dispatch.py over NCCL (EP needs one rank per GPU) and a
#      short pipeline run (pp=2, interleaved 1F1B, bf16; a stage needs a GPU of its own).
#
#   bash benchmarks/gpu_check.sh                 # every visible GPU
#   NGPU=4 bash benchmarks/gpu_check.sh --quick  # extra args go to benchmarks/dispatch.py
#
# Each stage has a time limit (seconds; TEST_S, TRAIN_S, BENCH_S set three); a stage that
# fails or runs out is reported and the next one runs. ONLY="tests profile" runs some
# (keys: tests train fsdp bench profile ab dispatch pipeline). One log of every stage
# (gpu_check.log) and the JSON files land in $OUT (benchmarks/out by default). Works
# without installing the package (PYTHONPATH=src) on an image whose torch is older than
# the pin, and says so. The run of 2026-11-29 on one H200 (before the CPU kernel
# moved off the GPU path) ran all stages in 151 s (benchmarks/RESULTS.md, GPU section).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
OUT=${OUT:-benchmarks/out}
TEST_S=${TEST_S:-120}; TRAIN_S=${TRAIN_S:-100}; BENCH_S=${BENCH_S:-120}
export PYTHONUNBUFFERED=1

if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu_check: no CUDA device visible to torch; nothing to do" >&2
    exit 1
fi
"$PY" -c 'import epscale' 2>/dev/null || export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT"
NGPU=${NGPU:-$("$PY" -c 'import torch; print(torch.cuda.device_count())')}
FAILED=()
ONLY=${ONLY:-}  # e.g. ONLY="tests bench profile": run only the stages with these keys
LOG="$OUT/gpu_check.log"  # every stage's output, in order (one file: few files come back)
: > "$LOG"
stage() {  # stage KEY NAME LIMIT_S CMD...: run with a time limit, output to the log too
    local key=$1 name=$2 limit=$3; shift 3
    if [ -n "$ONLY" ] && [[ " $ONLY " != *" $key "* ]]; then return; fi
    echo "== $name (limit ${limit}s)" | tee -a "$LOG"
    local t0=$SECONDS
    timeout --signal=INT --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$LOG"
    local rc=${PIPESTATUS[0]}
    echo "== $name: rc $rc in $((SECONDS - t0)) s" | tee -a "$LOG"
    [ "$rc" -eq 0 ] || FAILED+=("$name (rc $rc)")
}

"$PY" - <<'PY'
import torch
from epscale.dispatch.deepep import deepep_available
print(f"torch {torch.__version__}, cuda {torch.version.cuda}, nccl {torch.cuda.nccl.version()}, "
      f"gpus {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}, "
      f"capability {torch.cuda.get_device_capability(0)}")
print("grouped_mm:", hasattr(torch.nn.functional, "grouped_mm"))
print("deep_ep:", "available" if deepep_available()[0] else deepep_available()[1])
major, minor = (int(v) for v in torch.__version__.split(".")[:2])
if (major, minor) < (2, 13):
    print(f"note: torch {torch.__version__} is older than epscale's pin (>= 2.13)")
PY

stage tests "layer tests on cuda" "$TEST_S" env EPSCALE_TEST_DEVICE=cuda \
    "$PY" -m pytest -q -p no:cacheprovider -o addopts="" -rfs tests/test_moe_layer.py \
    tests/test_router.py tests/test_model.py tests/test_optim.py

RUN_DIR=$(mktemp -d)/tiny
stage train "train on cuda, then resume" "$TRAIN_S" bash -c "
    '$PY' -m epscale train --config configs/tiny.yaml --run-dir '$RUN_DIR' parallel.ep=1 \
        train.steps=100 train.ckpt_every=50 train.eval_every=50 &&
    '$PY' -m epscale train --config configs/tiny.yaml --run-dir '$RUN_DIR' parallel.ep=1 \
        train.steps=150 train.ckpt_every=50 train.eval_every=50"

FSDP_DIR=$(mktemp -d)/fsdp
stage fsdp "FSDP bf16 + full recomputation on cuda, resume, memory estimate" "$TRAIN_S" bash -c "
    '$PY' -m epscale train --config configs/tiny.yaml --run-dir '$FSDP_DIR' parallel.ep=1 \
        parallel.fsdp=true train.dtype=bfloat16 train.activation_checkpointing=full \
        moe.experts_impl=grouped_mm train.steps=40 train.ckpt_every=20 train.eval_every=20 &&
    '$PY' -m epscale train --config configs/tiny.yaml --run-dir '$FSDP_DIR' parallel.ep=1 \
        parallel.fsdp=true train.dtype=bfloat16 train.activation_checkpointing=full \
        moe.experts_impl=grouped_mm train.steps=60 train.ckpt_every=20 train.eval_every=20 &&
    '$PY' benchmarks/memory.py --device cuda --json '$OUT/memory_gpu.json'"

stage bench "benchmarks/moe_layer.py --device cuda" "$BENCH_S" \
    "$PY" benchmarks/moe_layer.py --device cuda --dtypes bfloat16 --rounds 3 --reps 5 \
    --impls rows,torchtitan,mixtral-grouped --json "$OUT/moe_layer_gpu.json"
# Shapes large enough for the GPU's work to outweigh the host's launches: 64 experts of
# D=2048, F=1024 over 16k tokens, and Mixtral 8x7B's experts (D=4096, F=14336) over 8k.
for shape in 64,8,2048,1024,16384 8,2,4096,14336,8192; do
    stage bench "benchmarks/moe_layer.py --device cuda --shape $shape" "$BENCH_S" \
        "$PY" benchmarks/moe_layer.py --device cuda --dtypes bfloat16 --shape "$shape" \
        --rounds 2 --reps 3 --impls rows,torchtitan,mixtral-grouped
done
# launches, host syncs and the top kernels per step, ours beside torchtitan's
stage profile "benchmarks/profile_layer.py --device cuda" 90 \
    "$PY" benchmarks/profile_layer.py --device cuda --impls epscale,rows,torchtitan --tables \
    --find-syncs
# Mixtral 8x7B's experts: there the gap to torchtitan (0.89x on 2026-11-29) is device time
stage profile "benchmarks/profile_layer.py --device cuda --shape 8,2,4096,14336,8192" 90 \
    "$PY" benchmarks/profile_layer.py --device cuda --shape 8,2,4096,14336,8192 \
    --impls epscale,torchtitan --tables
# A GPU-side change against the revision it changes: carry that revision's source as .base
# (`mkdir -p .base && git archive REV src/epscale | tar -x -C .base`, .base ignored).
if [ -f .base/src/epscale/__init__.py ]; then
    for path in fused rows; do
        stage ab "benchmarks/ab_revisions.py --base .base --device cuda --path $path" "$BENCH_S" \
            "$PY" benchmarks/ab_revisions.py --base .base --device cuda \
            --path "$path" --configs coarse,fine,narrow --rounds 4 --reps 5
    done
fi
if [ "$NGPU" -lt 2 ] && { [ -z "$ONLY" ] || [[ " $ONLY " == *" dispatch "* ]]; }; then
    echo "gpu_check: $NGPU GPU(s): the EP dispatch benchmark needs >= 2; skipped" >&2
elif [ "$NGPU" -ge 2 ]; then
    EP_SIZES=$("$PY" -c "n=$NGPU; print(','.join(str(e) for e in (2, 4, 8) if n % e == 0))")
    stage dispatch "benchmarks/dispatch.py on $NGPU GPUs (NCCL), EP sizes $EP_SIZES" 300 \
        "$PY" -m torch.distributed.run --standalone --nproc-per-node "$NGPU" benchmarks/dispatch.py \
        --ep-sizes "$EP_SIZES" --layer-ep "$(( NGPU >= 4 ? 4 : 2 ))" --ranks-per-node "$NGPU" \
        --json "$OUT/dispatch_gpu.json" "$@"
    PP_DIR=$(mktemp -d)/pp
    stage pipeline "pipeline pp=2 x ep=$(( NGPU / 2 )) on $NGPU GPUs (NCCL), interleaved 1F1B, bf16" "$TRAIN_S" \
        "$PY" -m epscale train --config configs/tiny.yaml --nproc "$NGPU" --run-dir "$PP_DIR" \
        parallel.pp=2 parallel.ep=$(( NGPU / 2 )) model.num_layers=4 model.tie_embeddings=false \
        parallel.pp_schedule=interleaved_1f1b parallel.pp_virtual_stages=2 train.grad_accum=4 \
        train.dtype=bfloat16 train.steps=20
fi
if [ ${#FAILED[@]} -gt 0 ]; then
    printf 'gpu_check: failed: %s\n' "${FAILED[@]}" >&2
    exit 1
fi
echo "gpu_check: all stages passed"
