"""Run a script under DeepSpeed on CPU processes: `accelerate launch ... tests/deepspeed_on_cpu.py ppo.py ARGS`.

DeepSpeed itself runs on CPU (its CPU accelerator talks gloo), but accelerate 1.15 only learns the process group's size
from a backend it chose; on a machine with no GPU it chooses none and every process believes it is alone. Naming gloo
first makes accelerate see all processes. Tests only: on GPUs, launch the script directly.
"""
import runpy
import sys

from accelerate import PartialState

PartialState(backend="gloo")
script, sys.argv = sys.argv[1], sys.argv[1:]
runpy.run_path(script, run_name="__main__")
