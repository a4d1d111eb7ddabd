#!/usr/bin/env bash
# The GPU check in one call: everything that matters on CUDA, in at most 10 minutes on one
# GPU, with no internet. The stages (benchmarks/gpu_check.py says what each measures):
# grouped GEMM under CUDA's sync debug mode, the MoE layer against torchtitan (DeepSeek-
# and Mixtral-like shapes), a ~1B MoE trained on one-rank FSDP in bf16 per recompute mode
# (tokens/s, MFU, time breakdown, host syncs per step, peak memory against `epscale
# describe`), every EP dispatcher on a one-rank group against the local path, DeepEP when
# it imports, benchmarks/overlap.py when it exists. Each stage runs in its own process
# under its own cap; a failing stage is recorded and the next one runs. One JSON
# ($OUT/gpu_check.json) and one table.
#
#   bash benchmarks/gpu_check.sh                  # on the GPU machine
#   bash benchmarks/gpu_check.sh --dry-run        # every stage on CPU in CI size (seconds)
#   bash benchmarks/gpu_check.sh --only train     # other flags go to benchmarks/gpu_check.py
#
# Offline packages: wheels in $WHEELS (default .wheels/, git-ignored; carry it to the
# machine) are installed with --no-deps --no-index into a scratch folder put first on
# PYTHONPATH (torchtitan for the layer comparison, transformers for the tests); the
# image's torch is used as it is. The package runs from src/ without installing.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
export OUT=${OUT:-benchmarks/out}
export PYTHONUNBUFFERED=1
WHEELS=${WHEELS:-.wheels}
mkdir -p "$OUT"

if compgen -G "$WHEELS/*.whl" > /dev/null; then
    SITE=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check-site.XXXXXX")
    if "$PY" -m pip install --quiet --no-deps --no-index --target "$SITE" "$WHEELS"/*.whl; then
        export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
        echo "gpu_check: installed $(ls "$WHEELS"/*.whl | xargs -n1 basename | tr '\n' ' ')into $SITE"
    else
        echo "gpu_check: could not install the wheels in $WHEELS; going on without them" >&2
    fi
fi
"$PY" -c 'import epscale' 2>/dev/null || export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
exec "$PY" benchmarks/gpu_check.py "$@"
