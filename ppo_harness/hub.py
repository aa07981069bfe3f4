"""--push-to-hub: the run's final models to the Hugging Face Hub, as TRL's `Trainer.push_to_hub` and SFD's
--push_to_hub did, through huggingface_hub (`create_repo`, `upload_folder`). Checked before any model loads (the Hub
reachable, a token set, HF_HUB_OFFLINE unset); pushed once, at the end of a finished run, from the main process: the
policy (or its adapter), the tokenizer, the value head or value model, merged/ where there is one, the run's flags and
logs, and a model card (the command, the held-out scores, the commit). A push that fails loses nothing: the run folder
is complete, and the message gives the command that pushes it later. With --hub-strategy all_checkpoints each checkpoint
is pushed too when it is written, as the repository's branch `update-NNNNNN` (a failed one is said, and the run goes
on); else checkpoints stay local."""
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

# what stays in the run folder: the resume state (large), the lock, wandb's local files, unfinished writes
NOT_PUSHED = ["checkpoints/*", ".lock", "wandb/*", "*.tmp"]


def offline() -> bool:
    """HF_HUB_OFFLINE as huggingface_hub reads it (read here: its constant is read once, at import)."""
    return os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")


def check_hub(args) -> None:
    """Refuse --push-to-hub where it cannot push (offline, no token, the Hub unreachable), and the Hub flags without
    it, before any model loads."""
    if not getattr(args, "push_to_hub", False):
        given = [flag for flag, value in (("--hub-model-id", getattr(args, "hub_model_id", None)),
                                          ("--hub-private-repo", getattr(args, "hub_private_repo", False)),
                                          ("--hub-strategy all_checkpoints",
                                           getattr(args, "hub_strategy", "end") == "all_checkpoints")) if value]
        if given:
            raise ValueError(f"{' and '.join(given)} name the Hub repository --push-to-hub pushes to: add "
                             "--push-to-hub, or drop them")
        return
    if not args.save_at_end:
        raise ValueError("--push-to-hub pushes the models saved at the end, which --no-save-at-end skips: drop one")
    if offline():
        raise ValueError("--push-to-hub: HF_HUB_OFFLINE=1 is set, so nothing can reach the Hub; unset it, or drop "
                         "--push-to-hub and push the run folder later (`hf upload REPO RUN_FOLDER`)")
    from huggingface_hub import HfApi, get_token

    if get_token() is None:
        raise ValueError("--push-to-hub: no Hugging Face token; log in (`hf auth login`) or set HF_TOKEN")
    try:
        HfApi().whoami()
    except Exception as e:  # network down, a revoked token: said now, not after the run
        raise ValueError(f"--push-to-hub: the Hub did not answer ({type(e).__name__}: {e}); check the network and "
                         "the token, or drop --push-to-hub and push the run folder later") from None


def model_card(args, folder: Path, repo_id: str) -> str:
    """The repository's README.md: what trained it, how it scored on held-out prompts, at which commit."""
    scores = []
    metrics = folder / "metrics.jsonl"
    if metrics.exists():
        for line in metrics.read_text().splitlines():
            row = json.loads(line)
            if "eval/scores" in row:
                scores.append((row["update"], row["eval/scores"]))
    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(sys.argv[0]).resolve().parent,
                         capture_output=True, text=True)
    commit = git.stdout.strip() or "unknown"
    held_out = "\n".join(f"| {u} | {s:.4f} |" for u, s in scores) or "| - | not evaluated (--eval-samples 0) |"
    return f"""---
library_name: transformers
tags: [ppo, rlhf]
---
# {repo_id}

Trained with PPO by `{Path(sys.argv[0]).name}` (commit `{commit}`, {time.strftime('%Y-%m-%d')}) from
`{getattr(args, 'sft_model_path', '?')}`:

```bash
python {shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]])}
```

Held-out score (`eval/scores`: the reward of responses to prompts never trained on) by update:

| update | eval/scores |
|---|---|
{held_out}

The value is `value_head.safetensors` (a head on the policy's final hidden states) or `value_model/`.
"""


def push_run(args, folder: Path, run_name: str, console) -> bool:
    """Push the finished run's folder (without its checkpoints) to --hub-model-id (default: the user's namespace,
    the run's name); whether it was pushed. A failure is said with the command that pushes the folder later."""
    from huggingface_hub import HfApi

    api = HfApi()
    repo_id = args.hub_model_id
    try:
        repo_id = repo_of(api, args, run_name)
        api.create_repo(repo_id, private=args.hub_private_repo, exist_ok=True, repo_type="model")
        (folder / "README.md").write_text(model_card(args, folder, repo_id))
        api.upload_folder(repo_id=repo_id, folder_path=folder, repo_type="model", ignore_patterns=NOT_PUSHED,
                          commit_message=f"PPO run {run_name}")
    except Exception as e:
        later = f"hf upload {repo_id or 'USER/' + run_name} {folder} . " + " ".join(
            f"--exclude '{pattern}'" for pattern in NOT_PUSHED)
        console.print(f"[red]--push-to-hub failed ({type(e).__name__}: {e}). The run folder {folder} is "
                      f"complete; push it later with:\n  {later}")
        return False
    console.print(f"pushed to https://huggingface.co/{repo_id}")
    return True


def repo_of(api, args, run_name: str) -> str:
    """--hub-model-id, or the user's namespace / the run's name."""
    return args.hub_model_id or f"{api.whoami()['name']}/{run_name}"


def push_checkpoint(args, checkpoint: Path, run_name: str, console) -> bool:
    """--hub-strategy all_checkpoints: one checkpoint's folder (the resume state: weights, optimizer, random states) as
    the repository's branch of its name, `update-NNNNNN`; whether it was pushed. A failure is said, with the command
    that pushes it later, and the run goes on (the checkpoint is on disk)."""
    from huggingface_hub import HfApi

    api, branch, repo_id = HfApi(), checkpoint.name, args.hub_model_id
    try:
        repo_id = repo_of(api, args, run_name)
        api.create_repo(repo_id, private=args.hub_private_repo, exist_ok=True, repo_type="model")
        api.create_branch(repo_id, branch=branch, exist_ok=True, repo_type="model")
        api.upload_folder(repo_id=repo_id, folder_path=checkpoint, revision=branch, repo_type="model",
                          commit_message=f"PPO run {run_name}: checkpoint {branch}")
    except Exception as e:
        console.print(f"[red]--hub-strategy all_checkpoints: checkpoint {branch} was not pushed ({type(e).__name__}: "
                      f"{e}); it is in {checkpoint}, and the run goes on. Push it later with:\n  hf upload "
                      f"{repo_id or 'USER/' + run_name} {checkpoint} . --revision {branch}")
        return False
    console.print(f"pushed checkpoint {branch} to https://huggingface.co/{repo_id}/tree/{branch}")
    return True
