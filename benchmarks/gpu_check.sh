#!/usr/bin/env bash
# Run the layer and dispatch benchmarks on a CUDA machine with NCCL (one node, all GPUs).
#
#   bash benchmarks/gpu_check.sh                 # every visible GPU
#   NGPU=4 bash benchmarks/gpu_check.sh --quick  # extra args go to benchmarks/dispatch.py
#
# EP needs at least 2 GPUs (NCCL allows one rank per GPU). The dispatch benchmark checks
# every backend's output against alltoall's first, and includes 'deepep' when the
# deep_ep package is importable. Results are printed and saved under benchmarks/out/.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
OUT=${OUT:-benchmarks/out}

if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu_check: no CUDA device visible to torch; nothing to do" >&2
    exit 1
fi
mkdir -p "$OUT"
NGPU=${NGPU:-$("$PY" -c 'import torch; print(torch.cuda.device_count())')}
"$PY" - <<'PY'
import torch, torch.distributed as dist
from epscale.dispatch.deepep import deepep_available
print(f"torch {torch.__version__}, cuda {torch.version.cuda}, nccl {torch.cuda.nccl.version()}, "
      f"gpus {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}")
print("deep_ep:", "available" if deepep_available()[0] else deepep_available()[1])
PY

if [ -f benchmarks/moe_layer.py ]; then
    echo "== benchmarks/moe_layer.py --device cuda (single GPU)"
    "$PY" benchmarks/moe_layer.py --device cuda --dtypes bfloat16 --impls rows,grouped,inductor,torchtitan,mixtral-grouped \
        --json "$OUT/moe_layer_gpu.json" | tee "$OUT/moe_layer_gpu.txt"
fi
if [ -f benchmarks/combine.py ]; then
    echo "== benchmarks/combine.py --device cuda (the embedding_bag combines vs the forms they replaced)"
    "$PY" benchmarks/combine.py --device cuda --json "$OUT/combine_gpu.json" | tee "$OUT/combine_gpu.txt"
fi

if [ "$NGPU" -lt 2 ]; then
    echo "gpu_check: $NGPU GPU(s): the EP dispatch benchmark needs >= 2; skipped" >&2
    exit 0
fi
EP_SIZES=$("$PY" -c "n=$NGPU; print(','.join(str(e) for e in (2, 4, 8) if n % e == 0))")
echo "== benchmarks/dispatch.py on $NGPU GPUs (NCCL), EP sizes $EP_SIZES"
"$PY" -m torch.distributed.run --standalone --nproc-per-node "$NGPU" benchmarks/dispatch.py \
    --ep-sizes "$EP_SIZES" --layer-ep "$(( NGPU >= 4 ? 4 : 2 ))" --ranks-per-node "$NGPU" \
    --json "$OUT/dispatch_gpu.json" "$@" | tee "$OUT/dispatch_gpu.txt"
