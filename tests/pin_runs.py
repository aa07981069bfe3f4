"""Behaviour pin for refactors: fixed short runs of both scripts, compared file by file to 1e-6 (metrics.jsonl,
samples.jsonl, ppo_tldr.py's eval tables, the final model.safetensors). Record before a refactor, compare after:

    python tests/pin_runs.py . runs/pin-before          # all configurations (about 3 minutes on 2 cores)
    python tests/pin_runs.py . runs/pin-after lora cross_tok     # or some of them
    python tests/pin_runs.py --compare runs/pin-before runs/pin-after   # prints ALL MATCH or the differences
    python tests/pin_runs.py --compare runs/pin-before runs/pin-after --new-keys eval/kl   # a metric added
    python tests/pin_runs.py --cuda . runs/pin-cuda     # on a GPU machine: the CUDA and bf16 paths (see on_cuda)

Not a test (pytest does not collect it). The tiny models and prompts are built once, from tests/ helpers, into
cache/pin_assets; `default_smollm2` runs the real default model for one update of 128 responses.
"""

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

ASSETS = Path(__file__).resolve().parents[1] / "cache" / "pin_assets"
NEW_KEYS = set()  # --new-keys: keys the new runs' rows add, not counted as a difference


def build_assets(repo: Path):
    sys.path.insert(0, str(repo / "tests"))
    import conftest
    from test_rewards import chat_tokenizer, foreign_tokenizer, tiny_config, chat_messages
    import torch
    from transformers import (
        GPTNeoXForCausalLM,
        GPTNeoXForSequenceClassification,
        AutoModelForSequenceClassification,
        AutoTokenizer,
    )

    if (ASSETS / "done").exists():
        return
    shutil.rmtree(ASSETS, ignore_errors=True)
    ASSETS.mkdir(parents=True)
    conftest.build_models(ASSETS)
    conftest.write_prompts(ASSETS / "prompts.jsonl")
    # chat policy + same-tokenizer RM + foreign RM (tests/test_rewards.py's chat fixture)
    torch.manual_seed(0)
    tok = chat_tokenizer()
    policy = GPTNeoXForCausalLM(tiny_config(36))
    with torch.no_grad():
        direction = torch.randn(32)
        policy.gpt_neox.final_layer_norm.bias.copy_(4 * direction / direction.norm())
        policy.get_output_embeddings().weight[32] = 0.4 * direction / direction.norm()
    policy.save_pretrained(ASSETS / "chat_sft")
    tok.save_pretrained(ASSETS / "chat_sft")
    config = tiny_config(36)
    config.num_labels = 1
    GPTNeoXForSequenceClassification(config).save_pretrained(ASSETS / "rm_same")
    tok.save_pretrained(ASSETS / "rm_same")
    config = tiny_config(35, max_positions=64)
    config.num_labels, config.pad_token_id, config.eos_token_id = 1, None, 1
    GPTNeoXForSequenceClassification(config).save_pretrained(ASSETS / "rm_other")
    foreign_tokenizer().save_pretrained(ASSETS / "rm_other")
    rng = random.Random(0)
    (ASSETS / "chat_prompts.jsonl").write_text(
        "".join(json.dumps({"prompt": chat_messages(rng)}) + "\n" for _ in range(40))
    )
    # tldr data + biased RM (tests/test_tldr.py's tldr fixture)
    from test_tldr import tldr_rows, write_jsonl, BIAS

    rm = AutoModelForSequenceClassification.from_pretrained(ASSETS / "gpt_neox_rm")
    rm.config.bias = BIAS
    rm.save_pretrained(ASSETS / "rm_bias")
    AutoTokenizer.from_pretrained(ASSETS / "gpt_neox_rm").save_pretrained(ASSETS / "rm_bias")
    write_jsonl(ASSETS / "tldr_train.jsonl", tldr_rows(40, 0))
    write_jsonl(ASSETS / "tldr_valid.jsonl", tldr_rows(6, 1))
    (ASSETS / "done").write_text("ok")


A = ASSETS
RFN = "tests/rewards.py:target_word_fraction"
# the small batch both scripts run: 2 minibatches of 2 accumulated micro-batches of 4, 2 epochs, 8-token responses
BATCH = ("--per-device-train-batch-size 4 --gradient-accumulation-steps 2 --num-mini-batches 2 --num-ppo-epochs 2 "
         "--local-rollout-forward-batch-size 8 --response-length 8 --learning-rate 1e-3").split()
TINY = ["--total-episodes", "32", *BATCH, *"--eval-samples 4 --eval-every 1 --num-trainable-layers None "
        "--no-shared-value-head --kl-coef 0.05".split()]
BASE = ["--sft-model-path", f"{A}/gpt_neox_sft", "--dataset-name", f"{A}/prompts.jsonl", "--dataset-train-split",
        "train", *TINY]
TLDR = ["--sft-model-path", f"{A}/gpt_neox_sft", "--reward-model-path", f"{A}/rm_bias", "--dataset-name",
        f"{A}/tldr_train.jsonl", "--eval-dataset-name", f"{A}/tldr_valid.jsonl", "--max-query-length", "32",
        "--total-episodes", "64", *BATCH, *"--eval-samples 5 --eval-every 2 --stop-token eos --missing-eos-rule "
        "replace --penalty-reward-value -2.0 --seed 3 --kl-coef 0.1 --cliprange 0.3 --vf-coef 0.5 "
        "--cliprange-value 0.5 --gamma 0.99 --lam 0.9 --temperature 0.9 --max-grad-norm 0.5".split()]
REASONING = ("--num-generations 2 --value-warmup-updates 1 --lam 0.9 --lam-critic 1.0 --lam-length-alpha 0.5 "
             "--cliprange-high 0.28 --loss-aggregation token --positive-lm-coef 0.1 --positive-threshold 0.2 "
             "--dynamic-sampling").split()
ONE_CPU_BF16 = ["--cpu", "--mixed_precision", "bf16", "--num_processes", "1"]
CONFIGS = {  # name: (script, launcher: None, accelerate launch flags or an accelerate_configs/ file, args)
    "rm_value": ("ppo.py", None, [*BASE, "--reward-model-path", f"{A}/gpt_neox_rm", "--save-every", "1"]),
    "rfn": ("ppo.py", None, [*BASE, "--reward-fn", RFN, "--seed", "7"]),
    "lora": ("ppo.py", None, [*BASE, "--reward-fn", RFN, *"--use-peft --lora-target-modules all-linear "
                              "--shared-value-head --num-trainable-layers 1 --learning-rate 1e-2".split()]),
    "shared_head_trunk": ("ppo.py", None, [*BASE, "--reward-fn", RFN, *"--shared-value-head --num-trainable-layers 1 "
                                           "--gradient-checkpointing".split()]),
    "classic": ("ppo.py", None, [*BASE, "--reward-model-path", f"{A}/gpt_neox_rm", *"--kl-target 1 --kl-horizon 100 "
                                 "--kl-estimator full --target-kl 0.5 --ratio-threshold 5 --use-score-norm "
                                 "--score-clip 2 --whiten-rewards --missing-eos-penalty 1".split()]),
    "classic_k3": ("ppo.py", None, [*BASE, "--reward-fn", RFN, *"--kl-estimator k3 --use-score-scaling "
                                    "--stop-token-id 3 --no-shared-value-head --max-grad-norm None".split()]),
    "cross_tok": ("ppo.py", None, ["--sft-model-path", f"{A}/chat_sft", "--reward-model-path", f"{A}/rm_same",
                                   f"{A}/rm_other", "--reward-fn", RFN, "--reward-weights", "0.5", "1.5", "2.0",
                                   "--dataset-name", f"{A}/chat_prompts.jsonl", "--dataset-train-split", "train",
                                   *TINY, "--apply-chat-template", "auto", "--missing-eos-penalty", "1.0"]),
    "bf16": ("ppo.py", ONE_CPU_BF16, [*BASE, "--reward-model-path", f"{A}/gpt_neox_rm"]),
    "zero3": ("ppo.py", "deepspeed_zero3.yaml", [*BASE, "--reward-model-path", f"{A}/gpt_neox_rm",
                                                 "--num-trainable-layers", "1"]),
    "ddp2": ("ppo.py", "multi_cpu.yaml", [*BASE, "--reward-fn", RFN, "--shared-value-head"]),
    "default_smollm2": ("ppo.py", None, ["--total-episodes", "32", "--eval-samples", "8", "--eval-every", "1",
                                         "--num-mini-batches", "8"]),  # one update of 128, not the default's 512
    # the reasoning flags, all on (VC-PPO, VAPO, DAPO), then the critic-free baselines; over two processes too
    "reasoning": ("ppo.py", None, [*BASE, "--reward-fn", RFN, *REASONING]),
    "reasoning_grpo": ("ppo.py", None, [*BASE, "--reward-fn", RFN, *"--num-generations 4 --advantage-estimator grpo "
                                        "--loss-aggregation sequence --cliprange-high 0.28 --dynamic-sampling".split()]),
    "reasoning_ddp2": ("ppo.py", "multi_cpu.yaml", [*BASE, "--reward-fn", RFN, "--shared-value-head", *REASONING,
                                                    "--total-episodes", "64"]),  # 2 updates of 32
    "tldr": ("ppo_tldr.py", None, TLDR),
    "tldr_zero3": ("ppo_tldr.py", "deepspeed_zero3.yaml", TLDR),
    "tldr_bf16": ("ppo_tldr.py", ONE_CPU_BF16, TLDR),
}
CUDA_BF16 = ["--mixed_precision", "bf16", "--num_processes", "1"]


def on_cuda() -> dict:
    """`--cuda`, on a GPU machine: the one-process configurations (bf16 autocast on the GPU instead of the CPU's) and the
    default run in bf16 too. Not a pin (CUDA draws other random numbers): read the logs' banners and the metrics."""
    configs = {name: (script, CUDA_BF16 if launcher == ONE_CPU_BF16 else launcher, args)
               for name, (script, launcher, args) in CONFIGS.items() if not isinstance(launcher, str)}
    return {**configs, "default_smollm2_bf16": ("ppo.py", CUDA_BF16, CONFIGS["default_smollm2"][2])}


def run(repo: Path, out: Path, names):
    build_assets(repo)
    env = {
        **os.environ,
        "PYTHONHASHSEED": "0",
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "WANDB_MODE": "disabled",
        "PYTHONWARNINGS": "ignore::FutureWarning",
    }
    py = sys.executable
    for name in names:
        script, launcher, args = CONFIGS[name]
        od = out / name
        shutil.rmtree(od, ignore_errors=True)
        if launcher is None:
            cmd = [py, script]
        elif isinstance(launcher, list):
            cmd = [py, "-m", "accelerate.commands.launch", *launcher, script]
        else:
            cmd = [
                py,
                "-m",
                "accelerate.commands.launch",
                "--config_file",
                f"accelerate_configs/{launcher}",
                "--num_processes",
                "2",
                "--main_process_port",
                str(29500 + random.randint(0, 2000)),
            ]
            if launcher.startswith("deepspeed"):
                cmd += ["--mixed_precision", "no", "tests/deepspeed_on_cpu.py"]
            cmd += [script]
        e = dict(env)
        if launcher == "multi_cpu.yaml":
            e["ACCELERATE_USE_CPU"] = "true"
        if name == "default_smollm2":
            e["OMP_NUM_THREADS"] = "2"
        p = subprocess.run(
            [*cmd, *args, "--output-dir", str(od)], cwd=repo, env=e, capture_output=True, text=True, timeout=900
        )
        (out / f"{name}.log").write_text(p.stdout[-20000:] + "\n----\n" + p.stderr[-20000:])
        print(name, "rc", p.returncode, flush=True)


def rows(path):
    if not path.exists():
        return []
    return [json.loads(l) for l in path.read_text().splitlines() if l.strip()]


def close(a, b, path):
    if isinstance(a, dict) and isinstance(b, dict):
        a = {k: v for k, v in a.items() if k in b or k not in NEW_KEYS}
        if set(a) != set(b):
            return [f"{path}: keys differ {sorted(set(a) ^ set(b))}"]
        return [
            m
            for k in a
            if not (k == "eps" or k.startswith("time/") or k in ("timestamp",))
            for m in close(a[k], b[k], f"{path}.{k}")
        ]
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{path}: lengths {len(a)} != {len(b)}"]
        return [m for i, (x, y) in enumerate(zip(a, b)) for m in close(x, y, f"{path}[{i}]")]
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return [] if abs(a - b) <= 1e-6 * max(1.0, abs(b)) else [f"{path}: {a} != {b}"]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


def compare(base: Path, new: Path):
    ok = True
    for name in CONFIGS:
        for f in ("metrics.jsonl", "samples.jsonl"):
            b, n = rows(base / name / f), rows(new / name / f)
            if not (base / name).exists() or not (new / name).exists():
                continue
            diffs = close(n, b, f"{name}/{f}")
            if not b and f == "metrics.jsonl":
                diffs.append(f"{name}: baseline has no metrics")
            status = "OK" if not diffs else "DIFF"
            ok &= not diffs
            print(f"{status:4} {name}/{f} ({len(b)} rows)" + ("" if not diffs else "\n    " + "\n    ".join(diffs[:8])))
        if not (new / name).exists():
            continue
        for f in sorted((base / name).glob("eval/*")):
            if f.suffix in (".jsonl", ".json"):
                load = rows if f.suffix == ".jsonl" else (lambda p: json.loads(p.read_text()) if p.exists() else None)
                diffs = close(load(new / name / "eval" / f.name), load(f), f"{name}/eval/{f.name}")
            else:
                g = new / name / "eval" / f.name
                diffs = [] if g.exists() and g.read_bytes() == f.read_bytes() else [f"{name}/eval/{f.name} differs"]
            ok &= not diffs
            print(
                f"{'OK' if not diffs else 'DIFF':4} {name}/eval/{f.name}"
                + ("" if not diffs else "\n    " + "\n    ".join(diffs[:8]))
            )
        if (base / name / "model.safetensors").exists():
            from safetensors.numpy import load_file

            b, n = (
                load_file(base / name / "model.safetensors"),
                load_file(new / name / "model.safetensors") if (new / name / "model.safetensors").exists() else {},
            )
            bad = [
                k
                for k in b
                if k not in n
                or n[k].shape != b[k].shape
                or abs(n[k].astype("float64") - b[k].astype("float64")).max(initial=0) > 1e-6
            ]
            ok &= not bad
            print(
                f"{'OK' if not bad else 'DIFF':4} {name}/model.safetensors ({len(b)} tensors)"
                + ("" if not bad else f" differing: {bad[:5]}")
            )
    print("ALL MATCH" if ok else "MISMATCH")
    return ok


if __name__ == "__main__":
    if sys.argv[1] == "--compare":
        NEW_KEYS.update(sys.argv[5:] if sys.argv[4:5] == ["--new-keys"] else ())
        sys.exit(0 if compare(Path(sys.argv[2]), Path(sys.argv[3])) else 1)
    if sys.argv[1] == "--cuda":
        CONFIGS = on_cuda()
        del sys.argv[1]
    repo, out = Path(sys.argv[1]).resolve(), Path(sys.argv[2]).resolve()
    out.mkdir(parents=True, exist_ok=True)
    run(repo, out, sys.argv[3:] or list(CONFIGS))
