# Profile a window of a run's updates (never a whole run: its trace would not come back in time) with torch.profiler,
# and count per optimizer step what the host does in the PPO epochs (phase 6): kernel launches (a CUDA graph launch
# counts once), host syncs (cudaStreamSynchronize, cudaEventSynchronize, cudaDeviceSynchronize) and copies.
#
#   python benchmarks/profile_window.py OUT.json FIRST COUNT ppo.py --flags...   # updates FIRST .. FIRST+COUNT-1
#
# The script runs in this process, unchanged: the profiler steps at each update's log line, and phase 6 runs from
# its first micro-batch (accelerate's `accumulate`) to the check of its losses once per update
# (ppo_harness/run_log.py's check_finite_losses). OUT.json gets the counts;
# OUT.json's folder gets ops.txt, the window's busiest operators (CPU and CUDA time).
import json
import os
import runpy
import sys
import time

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function, schedule

out, first, count, script = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
sys.argv = sys.argv[4:]
sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # as `python script` would: it finds ppo_harness/
import accelerate  # noqa: E402
from ppo_harness import run_log  # noqa: E402 (after the path)

SYNCS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize")
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx", "cudaGraphLaunch")
activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
profiler = profile(activities=activities, schedule=schedule(wait=max(0, first - 2), warmup=min(1, first - 1),
                                                            active=count))
window = {"updates": [], "optimizer_steps": 0, "training_s": []}
phase = {}
log, accumulate, check = run_log.RunLog.log, accelerate.Accelerator.accumulate, run_log.check_finite_losses


def logged(self, update, metrics, *rest):
    log(self, update, metrics, *rest)
    if update > 0:  # update 0 is the initial held-out score
        if first <= update < first + count:
            window["updates"].append(update)
            window["optimizer_steps"] += int(metrics.get("policy/optimizer_steps", 0))
            window["training_s"].append(metrics.get("time/training"))
        profiler.step()


def opened(self, *args, **kwargs):
    if "range" not in phase:  # the update's first micro-batch
        phase["range"] = record_function("phase 6: the PPO epochs")
        phase["range"].__enter__()
    return accumulate(self, *args, **kwargs)


def checked(*args, **kwargs):
    try:
        return check(*args, **kwargs)
    finally:
        if "range" in phase:
            phase.pop("range").__exit__(None, None, None)


# patched before the script imports check_finite_losses from run_log
run_log.RunLog.log, accelerate.Accelerator.accumulate, run_log.check_finite_losses = logged, opened, checked
start = time.perf_counter()
profiler.start()
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
finally:
    profiler.stop()
events = profiler.events() or []
training = [(e.time_range.start, e.time_range.end) for e in events if e.name == "phase 6: the PPO epochs"]
within = [e for e in events if e.device_type == DeviceType.CPU and any(a <= e.time_range.start <= b
                                                                        for a, b in training)]
steps = max(1, window["optimizer_steps"])
names = {}
for e in within:
    names[e.name] = names.get(e.name, 0) + 1
result = {
    **window, "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU",
    "launches_per_step": sum(n for name, n in names.items() if name in LAUNCHES) / steps,
    "syncs_per_step": sum(n for name, n in names.items() if name in SYNCS) / steps,
    "copies_per_step": sum(n for name, n in names.items() if name.startswith("cudaMemcpy")) / steps,
    "aten_ops_per_step": sum(n for name, n in names.items() if name.startswith("aten::")) / steps,
    "cuda_time_s": sum(e.device_time_total for e in events if e.device_type == DeviceType.CUDA) / 1e6,
    "wall_s": time.perf_counter() - start,
    "most_called": sorted(names.items(), key=lambda kv: -kv[1])[:20],
}
with open(out, "w") as f:
    json.dump(result, f, indent=1)
table = profiler.key_averages().table(sort_by="self_cuda_time_total" if torch.cuda.is_available() else
                                      "self_cpu_time_total", row_limit=30, max_name_column_width=60)
with open(os.path.join(os.path.dirname(os.path.abspath(out)), "ops.txt"), "w") as f:
    f.write(table)
print(json.dumps({k: v for k, v in result.items() if k != "most_called"}))
