"""The harness of ppo.py, ppo_tldr.py and ppo_multiturn.py: what no experiment edits, written once and
imported by the scripts. It imports no script, computes no loss and steps no optimizer (the scripts hold
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
- `prompt_files`: prompt files loaded with every bad line or row named, the default run's prompts,
  and the prompts as token ids (text, or chat messages through the chat template);
- `forwards`: the parts of a model the forwards reach into (its blocks, the model inside peft), and
  the README ledger's hand-written forwards, each checked against the script's own: the frozen trunk
  (--num-trainable-layers) run once per update or kept while sampling, and training's LM head over
  vocabulary blocks standing in for the script's training forward;
- `models`: model files (a GGUF converted once, weight files checked), DeepSpeed ZeRO-3's handling,
  the fresh LoRA adapter's config and the reference as the adapter switched off;
- `tokenizers`: the chat template's use, the end-of-turn token, a reward model's own tokenizer, and
  their checks;
- `keywords`: the keywords TRL calls a reward function with (no dataset column may take one);
- `user_code`: the module a flag's `file.py:name` or `module:name` names, imported, a failure named;
- `reward_fns`: reward functions loaded (a built-in name, module:function, file.py:function, a URL);
- `reward_server`: a served reward over HTTP, in this script's keywords or OpenRLHF's protocol;
- `reward_stacks`: OpenRLHF's `reward_func` and verl's `compute_score`, called as TRL calls a
  function;
- `rewards`: the run's rewards as one record, resolved from the flags and tried before any model
  loads, and the banner's lines on them;
- `reward_models`: reward models with a tokenizer of their own, reading the decoded text;
- `reward_calls`: reward functions called as TRL calls them (sync, async awaited together), each
  output checked, and the record of what they said and logged;
- `event_loop`: the one event loop async reward functions and environments are awaited on;
- `environments`: ppo_multiturn.py's environments loaded and called (this collection's reset/step
  protocol, OpenRLHF's agents), every answer checked; `guess_number`, its default task;
- `reward_logs`: what reward functions log, each reward's mean, the sample tables' rows, the
  held-out metrics;
- `speed`: --compile's settings, and the CUDA static-cache sampler that stands in for the policy in
  the script's `generate` where its probe passes (README: the ledger).
"""
import os as _os


def _check_compile_cache_folder() -> None:
    """A TORCHINDUCTOR_CACHE_DIR that cannot be made stops the run here, by name: torch's compiler
    makes that folder when it is imported (peft and transformers import it), which would end every
    run, --compile off too, in a traceback from inside that import."""
    given = _os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if given:
        try:
            _os.makedirs(given, exist_ok=True)
        except OSError as e:
            raise SystemExit(f"TORCHINDUCTOR_CACHE_DIR={given}: that folder cannot be made ({e.strerror}); "
                             "unset it (compiled runs then use cache/torch_compile) or point it to a "
                             "folder that can be written") from None


_check_compile_cache_folder()  # on import: each script imports this package before peft
