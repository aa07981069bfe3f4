# Run a Python script (argv[2:]) in this process and write its peak CUDA memory, as torch's allocator counts it, to
# argv[1] as JSON when it exits: `python benchmarks/cuda_peak.py peak.json ppo.py --flags...`.
import atexit
import json
import os
import runpy
import sys

import torch

out, script = sys.argv[1], sys.argv[2]
atexit.register(lambda: open(out, "w").write(json.dumps(
    {"peak_bytes": torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0})))
sys.argv = sys.argv[2:]
sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # as `python script` would: ppo.py finds ppo_harness/
runpy.run_path(script, run_name="__main__")
