"""The harness of ppo.py and ppo_tldr.py: what no experiment edits, written once and imported by both scripts. It
imports neither script, computes no loss and steps no optimizer (the scripts hold the algorithm). Each module has one
concern and reads alone:

- `launch`: the flags' intervals, accelerate's processes and DeepSpeed's settings, every machine launched alike;
- `run_folder`: the run's folder (lock, claim, the resume check), checkpoints with checksums, the models at the end;
- `writes`: files written whole (a temporary name, then a rename), a full disk named;
- `run_log`: the banner, metrics.jsonl, TensorBoard, wandb, the console line;
- `prompt_files`: prompt files loaded with every bad line or row named, and the default run's prompts;
- `models`: model files (a GGUF converted once, weight files checked), a model's parts, DeepSpeed ZeRO-3's handling;
- `reward_fns`: reward functions loaded (a built-in name, module:function, file.py:function, a URL);
- `reward_server`: a served reward over HTTP, in this script's keywords or OpenRLHF's protocol;
- `reward_stacks`: OpenRLHF's `reward_func` and verl's `compute_score`, called as TRL calls a function;
- `reward_calls`: reward functions called as TRL calls them (sync, async awaited together), each output checked;
- `reward_logs`: what reward functions log, each reward's mean, the sample tables' rows, the held-out metrics;
- `speed`: exact shortcuts behind the scripts' plain forwards, each switched on by a start-up probe (optional: without
  it the scripts run as with --no-fast-paths).
"""
