"""ppo.py (or PPO_HUB_SCRIPT) with huggingface_hub's network calls recorded instead of made: `whoami` answers
"tester", a token is set, `create_repo`, `create_branch` and `upload_folder` are written as JSON lines to PPO_HUB_RECORD,
and the files `upload_folder` would upload (its ignore patterns applied as huggingface_hub applies them) are copied into
PPO_HUB_REMOTE (a branch's into PPO_HUB_REMOTE/@<branch>), where a test loads them as a user of the repository would. PPO_HUB_FAIL=1: the upload raises. Run by
tests/test_hub.py; HF_HUB_OFFLINE is lifted for the script's check (every model here is a local folder)."""
import json
import os
import runpy
import shutil
import sys
from pathlib import Path

import huggingface_hub
from huggingface_hub.utils import filter_repo_objects

RECORD, REMOTE = Path(os.environ["PPO_HUB_RECORD"]), Path(os.environ["PPO_HUB_REMOTE"])


def record(call: str, **kwargs) -> None:
    with open(RECORD, "a") as f:
        f.write(json.dumps({"call": call, **kwargs}, default=str) + "\n")


def whoami(self, token=None, **kwargs):
    record("whoami")
    return {"name": "tester"}


def create_repo(self, repo_id, **kwargs):
    record("create_repo", repo_id=repo_id, **kwargs)
    return f"https://huggingface.co/{repo_id}"


def create_branch(self, repo_id, *, branch, **kwargs):
    record("create_branch", repo_id=repo_id, branch=branch, **kwargs)


def upload_folder(self, *, repo_id, folder_path, **kwargs):
    record("upload_folder", repo_id=repo_id, folder_path=str(folder_path), **kwargs)
    if os.environ.get("PPO_HUB_FAIL"):
        raise ConnectionError("the Hub went away")
    root, remote = Path(folder_path), REMOTE / f"@{kwargs['revision']}" if kwargs.get("revision") else REMOTE
    files = [p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()]
    for rel in filter_repo_objects(files, allow_patterns=kwargs.get("allow_patterns"),
                                   ignore_patterns=kwargs.get("ignore_patterns")):
        (remote / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(root / rel, remote / rel)


huggingface_hub.HfApi.whoami, huggingface_hub.HfApi.create_repo = whoami, create_repo
huggingface_hub.HfApi.upload_folder, huggingface_hub.HfApi.create_branch = upload_folder, create_branch
huggingface_hub.get_token = lambda: "hf_recorded"
os.environ.pop("HF_HUB_OFFLINE", None)
script = Path(__file__).resolve().parents[1] / os.environ.get("PPO_HUB_SCRIPT", "ppo.py")
sys.argv = [str(script), *sys.argv[1:]]
runpy.run_path(str(script), run_name="__main__")
