"""Models as files and as modules: a hub id, folder or GGUF file resolved to a loadable folder, the
checks a model's files get before anything loads, the parts of a transformers model the scripts
reach into (its blocks, the model inside a peft wrapper), and DeepSpeed ZeRO-3's handling of models
built, initialised and sampled from while sharded."""
import copy
import importlib.util
import json
import os
import shutil
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from ppo_harness.forwards import transformer_blocks
from ppo_harness.writes import temporary_name


@dataclass
class ModelFiles:
    """The models a run reads, resolved to loadable folders and checked (`model_files`)."""
    sft_model_path: str  # the SFT policy's folder (a peft checkpoint's base model)
    sft_adapters: dict  # a peft checkpoint's adapters by name (empty for a plain model)
    reward_model_paths: list[str]
    reward_configs: list  # each reward model's config
    value_model_path: str | None  # --value-model-path's folder, if given
    config: object  # the policy's config


def model_files(args, accelerator) -> ModelFiles:
    """Every model flag resolved to a folder (a GGUF converted once into cache/, by the run's first
    process, then each machine's) and checked before anything loads: a peft checkpoint's adapters
    (`check_sft_adapters`), unreadable or truncated weight files, reward models that are no
    one-label classifiers, a --stop-token-id past the vocabulary, a --num-trainable-layers past the
    blocks."""
    remote = dict(trust_remote_code=args.trust_remote_code)
    with accelerator.main_process_first(), accelerator.local_main_process_first():
        sft_model_path = resolve_model_path(args.sft_model_path)
        # a peft checkpoint: its adapters go on the base it names
        sft_adapters = checkpoint_adapters(sft_model_path)
        if sft_adapters:
            adapter_config = json.loads((next(iter(sft_adapters.values()))
                                         / "adapter_config.json").read_text())
            sft_model_path = resolve_model_path(adapter_config["base_model_name_or_path"])
        # ppo_multiturn.py has no reward models: its environment rewards
        reward_model_paths = [resolve_model_path(p) for p in getattr(args, "reward_model_path", ())]
        value_model_path = (resolve_model_path(args.value_model_path) if args.value_model_path
                            else None)
    check_sft_adapters(args, sft_adapters)
    for flag, path in [("--sft-model-path", sft_model_path),
                       *[("--reward-model-path", p) for p in reward_model_paths],
                       ("--value-model-path", value_model_path)]:
        check_weight_files(flag, path)
    reward_configs = [check_scalar_model(p, "--reward-model-path", require_head=True, **remote)
                      for p in reward_model_paths]
    config = AutoConfig.from_pretrained(sft_model_path, **remote)
    vocab_size = config.get_text_config().vocab_size
    if args.stop_token_id is not None and args.stop_token_id >= vocab_size:
        raise ValueError(f"--stop-token-id {args.stop_token_id}: the policy has {vocab_size} "
                         f"tokens (ids 0 to {vocab_size - 1}), so it could never sample it")
    layers = args.num_trainable_layers
    if layers is not None and not 0 < layers <= config.num_hidden_layers:
        raise ValueError(f"--num-trainable-layers {layers}: the model has "
                         f"{config.num_hidden_layers} transformer blocks")
    return ModelFiles(sft_model_path, sft_adapters, reward_model_paths, reward_configs,
                      value_model_path, config)


def check_sft_adapters(args, sft_adapters: dict[str, Path]) -> None:
    """Refuse a peft checkpoint as SFT model whose adapters this script cannot train or use as
    reference."""
    for name, path in sft_adapters.items():
        peft_type = json.loads((path / "adapter_config.json").read_text()).get("peft_type")
        if peft_type in ("PROMPT_TUNING", "P_TUNING", "PREFIX_TUNING", "MULTITASK_PROMPT_TUNING",
                         "ADAPTION_PROMPT"):
            raise ValueError(f"--sft-model-path {args.sft_model_path}: adapter {name!r} is "
                             f"{peft_type}, which changes what every block sees (no frozen trunk, "
                             "no adapter-free reference): give a checkpoint with a LoRA-style "
                             "adapter, or a merged model")
    if sft_adapters and not args.use_peft:
        raise ValueError(f"--sft-model-path {args.sft_model_path} is a peft checkpoint (adapters "
                         f"{sorted(sft_adapters)}): add --use-peft to train with it")
    if args.ref_adapter_name is not None and args.ref_adapter_name not in sft_adapters:
        raise ValueError(f"--ref-adapter-name {args.ref_adapter_name}: --sft-model-path "
                         f"{args.sft_model_path} carries no such adapter (it carries "
                         f"{sorted(sft_adapters) or 'none'})")


def check_weight_files(flag: str, path: str | None) -> None:
    """Refuse a local model's unreadable or truncated .safetensors file by path (safetensors names
    none)."""
    from safetensors import safe_open

    for file in sorted(Path(path).glob("*.safetensors")) if path and Path(path).is_dir() else []:
        try:
            # reads the header, checks the file is as long as it says
            with safe_open(str(file), "pt"):
                pass
        except Exception as error:
            raise ValueError(f"{flag} {path}: {file} cannot be read ({type(error).__name__}: "
                             f"{error}): truncated or unreadable; copy "
                             "or download it again") from None


def check_scalar_model(path: str, role: str, require_head: bool, trust_remote_code: bool = False):
    """Refuse a reward/value model that is not a one-label sequence classifier, before loading any
    weights."""
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    archs = config.architectures or []
    is_classifier = any(a.endswith("ForSequenceClassification") for a in archs)
    if require_head and not is_classifier:
        raise ValueError(f"{role} {path}: architectures {archs} is not a sequence classifier "
                         "(AutoModelForSequenceClassification with num_labels=1)")
    if is_classifier and config.num_labels != 1:
        raise ValueError(f"{role} {path}: has num_labels={config.num_labels}; a scalar "
                         "model needs num_labels=1")
    return config


def resolve_model_path(path: str) -> str:
    """A hub id or directory as it is; a GGUF file (or `package/file.gguf`) dequantised once into
    cache/."""
    if not path.endswith(".gguf"):
        # a path that cannot be a hub id ('name' or 'namespace/name') must exist: else the hub
        # client's complaint about repo id syntax would be all the user sees
        if ((path.startswith(("/", ".", "~")) or path.count("/") > 1)
                and not Path(path).expanduser().exists()):
            raise ValueError(f"{path}: no such model directory")
        return path
    gguf = Path(path)
    if not gguf.is_file():
        package, _, inner = path.partition("/")
        spec = importlib.util.find_spec(package) if package.isidentifier() else None
        if spec is None or not spec.submodule_search_locations:
            raise ValueError(f"{path}: no such GGUF file, and {package!r} is no installed package")
        gguf = Path(spec.submodule_search_locations[0]) / inner
        if not gguf.is_file():
            raise ValueError(f"{path}: package {package!r} has no file {inner!r}")
    out = Path("cache") / gguf.stem
    if not (out / "config.json").exists():
        print(f"converting {gguf} to {out} (once)")
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                         dtype=torch.float32)
        config = quantized.config
        # a GGUF-loaded model refuses save_pretrained: copy it into a clean one
        del config.quantization_config
        model = AutoModelForCausalLM.from_config(config)
        model.load_state_dict(quantized.state_dict())
        tmp = temporary_name(out)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            # complete or absent: a killed conversion is redone, never half-read
            os.replace(tmp, out)
        except OSError:  # fine if another run converted it meanwhile
            if not (out / "config.json").exists():
                raise
            shutil.rmtree(tmp)
    return str(out)


def checkpoint_adapters(path: str) -> dict[str, Path]:
    """The adapters of a peft checkpoint directory by name (`default` at its root); empty for a
    plain model."""
    root = Path(path)
    if not root.is_dir():
        return {}
    found = {"default": root} if (root / "adapter_config.json").is_file() else {}
    found.update({d.name: d for d in sorted(root.iterdir())
                  if (d / "adapter_config.json").is_file()})
    return found


@contextmanager
def outside_zero_init(ds_plugin):
    """Build a model outside ZeRO-3's zero.Init (a meta-device skeleton cannot be initialised inside
    it)."""
    if ds_plugin is None or ds_plugin.zero_stage != 3:
        yield
        return
    from transformers.integrations import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        ds_plugin.set_deepspeed_weakref()


def gathered_for_init(params):
    """Whole tensors of ZeRO-3-sharded parameters to initialise in place, written back from rank
    0."""
    params = list(params)
    if not any(hasattr(p, "ds_id") for p in params):
        return nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=0)


def shard_frozen(model: nn.Module, ds_config: dict) -> None:
    """A frozen model as a ZeRO-3 inference engine (TRL's prepare_deepspeed), called as before; the
    engine is kept on the model (discarding it would remove its hooks)."""
    import deepspeed

    config = copy.deepcopy({k: v for k, v in ds_config.items()
                            if k not in ("optimizer", "scheduler")})
    engine, *_ = deepspeed.initialize(model=model, config=config)
    engine.eval()
    model.__dict__["_deepspeed_engine"] = engine  # a plain attribute, not a submodule


# ---- LoRA: the fresh adapter's config, and the reference as the policy with its adapter off ------
def lora_config(args, model_config, trust_remote_code: bool = False):
    """The fresh adapter, on the top --num-trainable-layers blocks; tried on a meta-device copy,
    so unknown target modules fail before any load."""
    num_blocks, targets = model_config.num_hidden_layers, args.lora_target_modules
    top = (None if args.num_trainable_layers is None
           else list(range(num_blocks - args.num_trainable_layers, num_blocks)))
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(model_config,
                                                    trust_remote_code=trust_remote_code)
        if targets == ["all-linear"]:
            blocks = transformer_blocks(skeleton)[1]
            targets = sorted({n.split(".")[-1] for n, m in blocks.named_modules()
                              if isinstance(m, nn.Linear)})
        config = LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha,
                            lora_dropout=args.lora_dropout, target_modules=targets,
                            layers_to_transform=top, bias="none", task_type="CAUSAL_LM")
        try:
            get_peft_model(skeleton, config)
        except ValueError as e:  # peft's NoMatchingPeftModuleError is a ValueError
            raise ValueError(f"--lora-target-modules {config.target_modules}: {e}") from None
    return config


@contextmanager
def reference_adapter(policy: PeftModel, ref_adapter_name: str | None, model_adapter_name: str):
    """Inside: the reference, adapter off or named (classic TRL's disable_adapter() without
    `with` did nothing)."""
    if ref_adapter_name is None:
        with policy.disable_adapter():
            yield
        return
    # inference_mode: the reference adapter stays frozen
    policy.set_adapter(ref_adapter_name, inference_mode=True)
    try:
        yield
    finally:
        policy.set_adapter(model_adapter_name)
