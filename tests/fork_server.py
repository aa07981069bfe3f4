"""The tests' runs of a script, forked from one process that has imported its libraries once.

On 2 CPU cores a tiny run of ppo.py takes about 12 s, 9 of them importing torch, transformers, peft and datasets. This
process imports them once, then forks a child per run: the child starts from a process that has run nothing (no
thread pool, no seed, no compiled graph), sets the run's directory, environment, argv and output files, runs the script
as `__main__` (as `python script.py` does), joins its threads, runs its exit handlers and exits with its code.
`conftest.run_ppo` and `conftest.launch` talk to it through stdin and stdout, one JSON line a run (for `launch`, a
child per process, with the environment `accelerate launch` would give it). Runs that a test signals, or launches on
two machines, start through `python` and `accelerate launch` themselves, so the scripts' own start is tested there."""
import atexit
import json
import os
import runpy
import signal
import sys
import threading
import time
import traceback

import accelerate  # noqa: F401  the scripts' libraries, imported once
import datasets  # noqa: F401
import peft  # noqa: F401
import torch  # noqa: F401
import transformers  # noqa: F401
import tyro  # noqa: F401

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import ppo  # noqa: F401, E402
import ppo_tldr  # noqa: F401, E402


def child(request: dict) -> None:
    """Run one script, as `python <script> <args>` in `cwd` with `env` would, and never return."""
    code = 1
    try:
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        with open(request["stdout"], "w") as out, open(request["stderr"], "w") as err:
            os.dup2(out.fileno(), 1)
            os.dup2(err.fileno(), 2)
        sys.argv = [request["script"], *request["args"]]
        sys.path[0] = os.path.dirname(os.path.abspath(request["script"]))
        extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
        sys.path[1:1] = extra  # as the interpreter puts PYTHONPATH after the script's folder
        try:
            runpy.run_path(request["script"], run_name="__main__")
            code = 0
        except SystemExit as e:
            if e.code is None or isinstance(e.code, int):
                code = e.code or 0
            else:
                print(e.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
        threading._shutdown()  # noqa: SLF001  as the interpreter does at exit: non-daemon threads finish
        atexit._run_exitfuncs()  # noqa: SLF001
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def serve() -> None:
    """Per request (a JSON line): fork a child per process, say their pids, wait for them and say their exit codes.
    As torchrun does, a process that fails gets the others SIGTERM (then SIGKILL after 30 s), since they would wait on
    it in a collective."""
    for line in sys.stdin:
        request = json.loads(line)
        pids = []
        for process in request["processes"]:
            pid = os.fork()
            if pid == 0:
                child({**request, **process})
            pids.append(pid)
        print(json.dumps({"pids": pids}), flush=True)
        codes, deadline = {}, None
        while len(codes) < len(pids):
            if deadline is not None and time.time() > deadline:
                for pid in set(pids) - set(codes):
                    os.kill(pid, signal.SIGKILL)
            pid, status = os.waitpid(-1, os.WNOHANG) if deadline is not None else os.waitpid(-1, 0)
            if pid == 0:
                time.sleep(0.1)
                continue
            codes[pid] = os.waitstatus_to_exitcode(status)
            if codes[pid] != 0 and deadline is None and len(codes) < len(pids):
                for other in set(pids) - set(codes):
                    os.kill(other, signal.SIGTERM)
                deadline = time.time() + 30
        print(json.dumps({"returncodes": [codes[pid] for pid in pids]}), flush=True)


if __name__ == "__main__":
    serve()
