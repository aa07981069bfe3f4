#!/bin/bash
# The prepared GPU check: benchmarks/gpu_bench.py on one lent GPU, in fp32 then bf16, each the dynamic sampler, ppo.py
# and TRL 1.12 (about 7 minutes on an H100; a run that would end past 420 s is skipped). Results and log tails go to
# $OUT. The GPU machine has no internet: prepare .gpu/ here first (benchmarks/README.md#gpu), then, with the device
# tool, run `bash benchmarks/gpu_check.sh` with carry [".gpu"] and a 540 s timeout.
set -u
OUT="${OUT:-runs/gpu_check}"
mkdir -p "$OUT"
PY="${GPU_CHECK_PYTHON:-python3}"
if ls .gpu/whl/*.whl >/dev/null 2>&1; then  # the pinned packages the machine lacks, beside its own torch
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .gpu/whl/*.whl \
    || { echo "the wheels did not install" | tee "$OUT/failed.txt"; exit 1; }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
"$PY" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
  | tee -a "$OUT/gpu.txt"
export HF_HUB_OFFLINE=1 WANDB_MODE=disabled PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false TRL_EXPERIMENTAL_SILENCE=1
"$PY" benchmarks/gpu_bench.py --trl-python "$PY" --tokenizer .gpu/tok --repeats 1 --budget-s "${GPU_CHECK_BUDGET_S:-420}" \
  --cache-dir /tmp/gpu_bench_cache --run-dir /tmp/gpu_bench_runs --output-dir "$OUT" "$@"
