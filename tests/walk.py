"""The walk a reader makes through a script: from the top of `main`'s update loop to the first optimizer step, every
function of the script and of ppo_harness/ that runs, in the order a reader meets it (first call first), traced
(sys.settrace) on a short run of the script with its default flags, only the models and prompts made tiny (the
default run's own shape: a value head on the policy, a frozen trunk, the VADER reward). Lambdas, comprehensions and
functions nested in another are read with the function they are in, so they are not counted.

    python tests/walk.py            # ppo.py's walk, one line a function, then the counts
    python tests/walk.py --json     # the same as JSON (tests/test_shape.py bounds it)

Not a test (pytest does not collect it): it runs a training run in this process.
"""
import ast
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the default run's flags, on the tiny test models: 2 updates of 16 responses, one frozen block of two
TINY_DEFAULT = ["--total-episodes", "32", "--per-device-train-batch-size", "4", "--num-mini-batches", "4",
                "--local-rollout-forward-batch-size", "8", "--response-length", "8", "--eval-samples", "4",
                "--num-trainable-layers", "1", "--save-every", "0"]


def loop_line(script: Path) -> int:
    """The line of `main`'s update loop (its first `for` statement)."""
    main = next(n for n in ast.parse(script.read_text()).body if isinstance(n, ast.FunctionDef) and n.name == "main")
    return next(n for n in ast.walk(main) if isinstance(n, ast.For)).lineno


def trace_walk(script: Path, argv: list[str]) -> list[tuple[str, str]]:
    """(file relative to the repository, qualified name) of each page and harness function the walk opens, in
    first-call order."""
    import importlib.util

    import tyro

    spec = importlib.util.spec_from_file_location(script.stem, script)
    module = importlib.util.module_from_spec(spec)
    sys.modules[script.stem] = module
    spec.loader.exec_module(module)
    page, harness, start = str(script.resolve()), str(ROOT / "ppo_harness") + os.sep, loop_line(script)
    walk, state = [], {"on": False, "done": False}

    def local(frame, event, arg):  # main's own lines: the walk starts at the update loop
        if event == "line" and frame.f_lineno == start:
            state["on"] = True
        return local

    def calls(frame, event, arg):
        if state["done"]:
            return None
        code = frame.f_code
        if code.co_name == "step" and f"torch{os.sep}optim" in code.co_filename and state["on"]:
            state["done"] = True  # the first optimizer step
            return None
        if code.co_filename == page and code.co_name == "main":
            return local
        opened = code.co_filename == page or code.co_filename.startswith(harness)
        if state["on"] and opened and not code.co_name.startswith("<") and "<locals>" not in code.co_qualname:
            entry = (str(Path(code.co_filename).resolve().relative_to(ROOT)), code.co_qualname)
            if entry not in walk:
                walk.append(entry)
        return None

    args = tyro.cli(module.Args, args=argv)
    sys.settrace(calls)
    try:
        module.main(args)
    finally:
        sys.settrace(None)
    return walk


def tiny_default_argv(root: Path) -> list[str]:
    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import build_models, write_prompts

    paths = build_models(root)
    return ["--sft-model-path", str(paths["sft"]), "--dataset-name", str(write_prompts(root / "prompts.jsonl")),
            "--dataset-train-split", "train", *TINY_DEFAULT, "--output-dir", str(root / "run")]


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("WANDB_MODE", "disabled")
    os.chdir(ROOT)
    with tempfile.TemporaryDirectory() as tmp:
        argv = tiny_default_argv(Path(tmp))
        with open(os.devnull, "w") as quiet:  # the run's own output is not the walk
            stdout, sys.stdout = sys.stdout, quiet
            try:
                walk = trace_walk(ROOT / "ppo.py", argv)
            finally:
                sys.stdout = stdout
    files = sorted({f for f, _ in walk})
    if "--json" in sys.argv:
        print(json.dumps({"walk": walk, "files": files}))
    else:
        for f, name in walk:
            print(f"{f}: {name}")
        print(f"{len(walk)} functions in {len(files)} files: {', '.join(files)}")
