# TRL 1.12's PPOTrainer on benchmarks/throughput.py's workload (CPU) or gpu_bench.py's (--cuda). Run by those scripts
# with the python of a SEPARATE environment (benchmarks/requirements-trl.txt): it imports trl, which ppo.py and the
# tests never do. The result: training seconds, the end of each update (a callback), the peak CUDA memory.
import argparse
import json
import time

import torch
from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, TrainerCallback
from trl.experimental.ppo import PPOConfig, PPOTrainer

parser = argparse.ArgumentParser()
for flag in ("--policy", "--reward", "--prompts", "--output-dir", "--hparams", "--result"):
    parser.add_argument(flag, required=True)
parser.add_argument("--episodes", type=int, required=True)
parser.add_argument("--cuda", action="store_true")
parser.add_argument("--bf16", action="store_true")
args = parser.parse_args()
hp = json.loads(args.hparams)

tokenizer = AutoTokenizer.from_pretrained(args.policy, padding_side="left")  # carries the distinct [PAD]
dataset = load_dataset("json", data_files=args.prompts, split="train")
dataset = dataset.map(lambda b: tokenizer(b["prompt"]), batched=True, remove_columns=dataset.column_names)
config = PPOConfig(
    output_dir=args.output_dir, total_episodes=args.episodes, bf16=args.bf16, fp16=False, use_cpu=not args.cuda,
    report_to="none", save_strategy="no", logging_steps=1, disable_tqdm=True, **hp)
policy = AutoModelForCausalLM.from_pretrained(args.policy)
ref_policy = AutoModelForCausalLM.from_pretrained(args.policy)
reward_model = AutoModelForSequenceClassification.from_pretrained(args.reward, num_labels=1)
value_model = AutoModelForSequenceClassification.from_pretrained(args.reward, num_labels=1)
trainer = PPOTrainer(args=config, processing_class=tokenizer, model=policy, ref_model=ref_policy,
                     reward_model=reward_model, value_model=value_model, train_dataset=dataset,
                     eval_dataset=dataset.select(range(8)))  # unused: num_sample_generations 0
update_ends = []


class UpdateClock(TrainerCallback):
    def on_step_end(self, *_, **__):
        update_ends.append(time.perf_counter() - start)


trainer.add_callback(UpdateClock())
start = time.perf_counter()
trainer.train()
train_s = time.perf_counter() - start
with open(args.result, "w") as f:
    json.dump({"train_s": train_s, "threads": torch.get_num_threads(), "update_ends": update_ends,
               "peak_bytes": torch.cuda.max_memory_allocated() if args.cuda else 0,
               "log": trainer.state.log_history}, f)
