"""Starting a run: each numeric flag within its interval (written into `Args` as Annotated[type,
"[low, high)"]), then accelerate's processes (DeepSpeed's settings made the flags'), and every
machine launched alike."""
import hashlib
import math
import os
import types
from dataclasses import asdict, fields
from datetime import timedelta
from typing import Literal, Union, get_args, get_origin, get_type_hints

import torch
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs, gather_object

from ppo_harness.hub import check_hub


def in_interval(value: float, interval: str) -> bool:
    """Whether `value` lies in an interval written like "[0, 1)" (NaN lies in none)."""
    low, high = (float(bound) for bound in interval[1:-1].split(","))
    return (low <= value if interval[0] == "[" else low < value) and (value <= high if interval[-1] == "]" else
                                                                       value < high)


def flag_intervals(args_class) -> dict[str, str]:
    """Each numeric flag's valid interval, from its Annotated[type, "[low, high)"] in `Args` (a None
    is no value)."""
    return {name: hint.__metadata__[0] for name, hint in get_type_hints(args_class, include_extras=True).items()
            if hasattr(hint, "__metadata__")}


def flag_choices(args_class) -> dict[str, tuple]:
    """Each flag typed Literal[...] (or Literal[...] | None): its choices, from `Args` alone, so a
    new choice is added in one place."""
    choices = {}
    for name, hint in get_type_hints(args_class).items():
        parts = get_args(hint) if get_origin(hint) in (Union, types.UnionType) else (hint,)
        literals = [c for part in parts if get_origin(part) is Literal for c in get_args(part)]
        if literals:
            choices[name] = (*literals, *((None,) if type(None) in parts else ()))
    return choices


def check_flags(args) -> None:
    """Refuse a numeric flag outside its interval, a value no Literal flag offers, a
    --resume-with-changes that names no flag, --resume auto without the folder to look in, and a
    flag that cannot act, by name."""
    if args.resume == "auto" and not args.output_dir:
        raise ValueError("--resume auto needs --output-dir: the run folder to "
                         "look for checkpoints in")
    unknown = {name.lstrip("-").replace("-", "_") for name in args.resume_with_changes} - set(asdict(args))
    if unknown:
        raise ValueError(f"--resume-with-changes {' '.join(sorted(unknown))}: no such flag")
    check_flags_act(args)
    check_hub(args)  # --push-to-hub: the Hub reachable now, not after the run
    for name, choices in flag_choices(type(args)).items():
        if getattr(args, name) not in choices:
            raise ValueError(f"unknown --{name.replace('_', '-')} {getattr(args, name)!r}: "
                             f"choose one of {choices}")
    for name, interval in flag_intervals(type(args)).items():
        value = getattr(args, name)
        for v in value if isinstance(value, tuple) else (value,):
            if v is not None and not in_interval(v, interval):
                raise ValueError(f"--{name.replace('_', '-')} {v} is out of range: it "
                                 f"must lie in {interval}")


def check_flags_act(args) -> None:
    """Refuse a flag given where it cannot act (it would be ignored without a word)."""
    if args.resume_with_changes and not args.resume:
        raise ValueError(f"--resume-with-changes {' '.join(args.resume_with_changes)}: no "
                         "--resume, so no flags are compared; add --resume auto (or a "
                         "checkpoint) to continue a run with them changed, or drop "
                         "it to start a new run")
    if args.overwrite and args.resume == "auto":
        raise ValueError("--overwrite deletes the run in --output-dir, which --resume auto "
                         "continues: drop --overwrite to continue it, or --resume to "
                         "start a new run there")
    default = next((f.default for f in fields(args) if f.name == "eval_every"), None)
    # the default: not given
    if getattr(args, "eval_samples", None) == 0 and args.eval_every not in (0, default):
        raise ValueError(f"--eval-every {args.eval_every}: --eval-samples 0 holds no prompts out "
                         "to evaluate; hold some out with --eval-samples, or drop --eval-every")


def start(args) -> tuple[Accelerator, bool]:
    """(the Accelerator, whether DeepSpeed ZeRO-3 shards the models). One optimizer step per
    minibatch needs the script's accumulation: a launcher's or DeepSpeed config's other value is
    refused (accelerate quietly prefers it). No DataLoader is prepared (the scripts'
    `rollout_indices`): with one, accelerate would also step after every micro-batch of each update
    that used an epoch's last batch (its sync_with_dataloader default), a latent TRL bug. A process
    whose peer died stops after --peer-timeout minutes in a collective: one bound on NCCL and gloo.
    """
    accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps, kwargs_handlers=[
        InitProcessGroupKwargs(timeout=timedelta(minutes=args.peer_timeout))])
    check_same_launch(accelerator, args)
    ds_plugin = accelerator.state.deepspeed_plugin
    ds_accumulation = ds_plugin.deepspeed_config.get("gradient_accumulation_steps", "auto") if ds_plugin else "auto"
    if accelerator.gradient_accumulation_steps != args.gradient_accumulation_steps or ds_accumulation not in (
            "auto", args.gradient_accumulation_steps):
        raise ValueError("gradient accumulation: the launcher or DeepSpeed config says "
                         f"{ds_accumulation if ds_accumulation != 'auto' else accelerator.gradient_accumulation_steps}, --gradient-accumulation-steps says {args.gradient_accumulation_steps}: remove it from the config and set the flag")
    zero3 = ds_plugin is not None and ds_plugin.zero_stage == 3
    # no DataLoader to infer the micro-batch from; DeepSpeed clips inside its own step
    if ds_plugin is not None:
        ds_plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = args.per_device_train_batch_size
        ds_plugin.deepspeed_config["gradient_clipping"] = args.max_grad_norm or 0.0
    if zero3:  # the final save consolidates the shards into one loadable checkpoint
        ds_plugin.deepspeed_config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    return accelerator, zero3


def check_same_launch(accelerator: Accelerator, args) -> None:
    """Machines launched with other flags or process counts would train apart or hang in a
    collective."""
    if accelerator.num_processes == 1:
        return
    flags = int.from_bytes(hashlib.sha256(repr(args).encode()).digest()[:7], "big")
    local = torch.tensor([[flags, int(os.environ.get("LOCAL_WORLD_SIZE", 1))]], device=accelerator.device)
    launches = accelerator.gather(local).tolist()  # (flags, processes on its machine) per process
    if any(f != launches[0][0] for f, _ in launches):
        raise ValueError("processes "
                         f"{[r for r, (f, _) in enumerate(launches) if f != launches[0][0]]} were "
                         "launched with other flags than process 0: start every machine with the "
                         "same command (only --machine_rank differs)")
    if any(size != launches[0][1] for _, size in launches):
        raise ValueError("the machines run different numbers of processes "
                         f"({sorted({s for _, s in launches})}): give every machine's launcher "
                         "the same --num_processes, the total over all machines")


def process_share(n: int, accelerator, in_step: bool = False) -> list[int]:
    """This process's share of n items (held-out prompts): every world-th, so each is handled once.
    Where processes step together (ZeRO-3's sampling), or there are fewer items than processes, the
    last shares wrap round to the first items so that every process has as many; `gather_once` keeps
    one of each."""
    rank, world = accelerator.process_index, accelerator.num_processes
    last = math.ceil(n / world) * world if in_step or n < world else n
    return [i % n for i in range(rank, last, world)] if n > 0 else []


def own_share(n: int, accelerator, in_step: bool = False) -> list[bool]:
    """Which items of this process's `process_share` are its own, not wrapped round from another
    process's: a judge is sent only these, so it sees each item once."""
    rank, world = accelerator.process_index, accelerator.num_processes
    last = math.ceil(n / world) * world if in_step or n < world else n
    return [i < n for i in range(rank, last, world)] if n > 0 else []


def gather_once(index: list[int], rows: list) -> list:
    """Every process's rows, each once in `index` order: where a process's share wrapped round to
    rows another holds, the first process's is kept. Every process gets the same list."""
    held = gather_object(list(zip(index, rows)))
    return [row for _, row in sorted(dict(reversed(held)).items())]


def summed_over_processes(accelerator, sums: dict, counts: dict) -> tuple[dict, dict]:
    """Each key's sums (float64 tensors of any shape) and count summed over all processes, in one gather:
    (the summed tensors, the summed counts), by key."""
    flat = torch.cat([torch.cat([v.reshape(-1).cpu() for v in sums.values()]),
                      torch.tensor(list(counts.values()))])
    flat = accelerator.gather(flat.to(accelerator.device).unsqueeze(0)).sum(0).cpu()
    sizes = [v.numel() for v in sums.values()]
    return dict(zip(sums, flat[:sum(sizes)].split(sizes))), dict(zip(counts, flat[sum(sizes):].tolist()))
