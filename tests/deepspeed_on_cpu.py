"""Run a script under DeepSpeed on CPU processes: `accelerate launch ... tests/deepspeed_on_cpu.py ppo.py ARGS`.

DeepSpeed itself runs on CPU (its CPU accelerator talks gloo), but accelerate 1.15 only learns the process group's size
from a backend it chose; on a machine with no GPU it chooses none and every process believes it is alone. Naming gloo
first makes accelerate see all processes. Tests only: on GPUs, launch the script directly.

ZeRO-3 keeps weights under `stage3_param_persistence_threshold` elements (DeepSpeed's default: 100,000) whole on every
process. Every weight of the tiny test models is under it, so the threshold is set to 0 here: the tests then run with
every weight really sharded, as a real model's large matrices are.
"""
import runpy
import sys

from accelerate import PartialState
from accelerate.utils import DeepSpeedPlugin

built = DeepSpeedPlugin.__post_init__


def every_weight_sharded(plugin):
    built(plugin)
    if plugin.zero_stage == 3:
        plugin.deepspeed_config["zero_optimization"]["stage3_param_persistence_threshold"] = 0


DeepSpeedPlugin.__post_init__ = every_weight_sharded
PartialState(backend="gloo")
script, sys.argv = sys.argv[1], sys.argv[1:]
runpy.run_path(script, run_name="__main__")
