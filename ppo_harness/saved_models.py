"""The models a run saves at its end, for plain transformers: the policy (or its adapters, and
merged), the value head or value model, the base model's tokenizer; and a saved value head loaded
back."""
from pathlib import Path

import torch.nn as nn

from ppo_harness.writes import disk_space_named

VALUE_HEAD_FILE = "value_head.safetensors"  # a value head's weight and bias (see `load_value_head`)


def save_models(accelerator, model: nn.Module, args, base_model_path: str, output_dir: Path, console) -> None:
    """The policy (a peft policy: its adapters) and the value (`value_head.safetensors`, or the
    value model's folder), for plain transformers, with the base model's tokenizer as given (a [PAD]
    the script added is a training-time device, outside the model's vocabulary). ppo.py's
    --merge-adapter: the trained adapter also merged onto a fresh --dtype copy of the base, in
    merged/ (under ZeRO-3 the live policy holds only this process's shards)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    accelerator.wait_for_everyone()
    unwrapped = accelerator.unwrap_model(model)
    state_dict = accelerator.get_state_dict(model)  # consolidates sharded (ZeRO-3) weights
    if not accelerator.is_main_process:
        return
    remote = dict(trust_remote_code=args.trust_remote_code)
    with disk_space_named(output_dir):
        tokenizer = AutoTokenizer.from_pretrained(base_model_path, **remote)
        tokenizer.save_pretrained(output_dir)
        unwrapped.policy.save_pretrained(output_dir, state_dict=sub_state(state_dict, "policy"))
        if getattr(args, "merge_adapter", False):
            # here: the run folder's users need no peft
            from ppo_harness.models import outside_zero_init

            with outside_zero_init(accelerator.state.deepspeed_plugin):
                base = AutoModelForCausalLM.from_pretrained(base_model_path, dtype=args.dtype, **remote)
            adapter = args.model_adapter_name or "default"
            adapter_dir = output_dir if adapter == "default" else output_dir / adapter
            PeftModel.from_pretrained(base, adapter_dir).merge_and_unload().save_pretrained(output_dir / "merged")
            tokenizer.save_pretrained(output_dir / "merged")
        head = getattr(unwrapped, "value_head", None)
        value_path = output_dir / (VALUE_HEAD_FILE if head is not None else "value_model")
        if head is not None:
            from safetensors.torch import save_file

            save_file({k: v.contiguous() for k, v in sub_state(state_dict, "value_head").items()}, value_path)
        else:
            unwrapped.value_model.save_pretrained(value_path, state_dict=sub_state(state_dict, "value_model"))
    policy_saved = "the policy adapter" if isinstance(unwrapped.policy, PeftModel) else "the policy"
    console.print(f"saved {policy_saved} to {output_dir} and the value to {value_path}")


def sub_state(state_dict: dict, name: str) -> dict:
    """The entries of one submodule (`policy`, `value_model`, `value_head`) of the wrapper's state
    dict."""
    return {k[len(name) + 1:]: v for k, v in state_dict.items() if k.startswith(name + ".")}


def load_value_head(path: str | Path) -> nn.Linear:
    """The head a --shared-value-head run saved: values = head(final hidden state of the saved
    policy)."""
    from safetensors.torch import load_file

    state = load_file(str(path))
    head = nn.Linear(state["weight"].size(1), 1, dtype=state["weight"].dtype)
    head.load_state_dict(state)
    return head
