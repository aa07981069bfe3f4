#!/bin/bash
# The prepared GPU check: benchmarks/gpu_bench.py's runs on one lent GPU, most important first (TRL and ppo.py in bf16,
# compiled cold and warm, --compile auto, a profiled window of 2 updates, fp32 with and without --tf32, TRL in fp32,
# ppo_tldr.py at pythia-1b's shape); a run that would end past the budget (420 s) is skipped. Results go to $OUT: at
# most 8 small files (results.md, results.json, gpu.txt, logs.txt: every run's log tail, ops.txt: the profile's).
# The GPU machine has no internet: prepare .gpu/ here first (benchmarks/README.md#gpu), then, with the device tool,
# run `bash benchmarks/gpu_check.sh` with carry [".gpu"] and a 540 s timeout.
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
"$PY" benchmarks/gpu_bench.py --trl-python "$PY" --tokenizer .gpu/tok --budget-s "${GPU_CHECK_BUDGET_S:-420}" \
  --cache-dir /tmp/gpu_bench_cache --run-dir /tmp/gpu_bench_runs --output-dir "$OUT" "$@"
ls -la "$OUT"
