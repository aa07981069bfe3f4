"""The harness of ppo.py and ppo_tldr.py: what no experiment edits, written once and imported by
both scripts. It imports neither script, computes no loss and steps no optimizer (the scripts hold
the algorithm). Each module has one concern and reads alone:

- `launch`: the flags' intervals, accelerate's processes and DeepSpeed's settings, every machine
  launched alike;
- `run`: the plumbing around `main`'s loop (a resume's states, the logs, the banner, checkpoints,
  the run's end);
- `run_folder`: the run's folder (claim, the resume check, a resume's changed flags, args.json);
- `folder_lock`: the folder's lock (host and pid), refused while its run lives, a stale one taken
  over;
- `checkpoints`: checkpoints written aside with checksums, pruned, found and verified for a resume;
- `log_files`: the jsonl logs read back (a torn last line dropped) and trimmed to a resume's start;
- `preemption`: SIGTERM and SIGINT: during start-up an error's exit, then a checkpoint and a stop;
- `saved_models`: the models saved at the end for plain transformers, a value head loaded back;
- `writes`: files written whole (a temporary name, then a rename), a full disk named;
- `run_log`: the banner, metrics.jsonl, TensorBoard, wandb, the console line;
- `prompt_files`: prompt files loaded with every bad line or row named, and the default run's
  prompts;
- `models`: model files (a GGUF converted once, weight files checked), a model's parts, DeepSpeed
  ZeRO-3's handling;
- `tokenizers`: the chat template's use, the end-of-turn token, a reward model's own tokenizer, and
  their checks;
- `keywords`: the keywords TRL calls a reward function with (no dataset column may take one);
- `reward_fns`: reward functions loaded (a built-in name, module:function, file.py:function, a URL);
- `reward_server`: a served reward over HTTP, in this script's keywords or OpenRLHF's protocol;
- `reward_stacks`: OpenRLHF's `reward_func` and verl's `compute_score`, called as TRL calls a
  function;
- `reward_calls`: reward functions called as TRL calls them (sync, async awaited together), each
  output checked;
- `reward_logs`: what reward functions log, each reward's mean, the sample tables' rows, the
  held-out metrics;
- `speed`: the shortcuts a script takes where a start-up check finds them equal to its own code (the
  shared prompt prefix, the compiled static-cache sampler, the fused LM head), the frozen trunk's
  plumbing, and --compile's.
"""
