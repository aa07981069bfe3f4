"""ppo.py, checking at every checkpoint that the data-parallel processes hold identical trainable weights (gradients
are averaged before each step) and the same KL coefficient and score moments; run through `accelerate launch` by
tests/test_multiprocess.py. Under DeepSpeed, whose ZeRO stages shard the weights, only the state is compared."""
import sys
from pathlib import Path

import torch
import tyro

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import ppo  # noqa: E402
import ppo_harness.run  # noqa: E402

save_checkpoint = ppo_harness.run.save_checkpoint


def save_checkpoint_where_replicas_agree(accelerator, folder, state):
    model = accelerator._models[0]
    weights = (sum(p.detach().double().sum() for p in model.parameters() if p.requires_grad)
               if accelerator.state.deepspeed_plugin is None else torch.zeros((), dtype=torch.float64))
    moments = state["score_moments"]
    controller = torch.tensor([state["kl_coef"], moments["mean"], moments["var"]], dtype=torch.float64)
    local = torch.cat([weights.reshape(1).cpu(), controller]).to(accelerator.device)
    gathered = accelerator.gather(local.unsqueeze(0))
    if not torch.all(gathered == gathered[0]):
        raise RuntimeError(f"update {state['update']}: the processes disagree (weight checksum, KL coefficient, "
                           f"score moments): {gathered.tolist()}")
    if accelerator.is_main_process:
        print(f"replicas agree after update {state['update']}")
    save_checkpoint(accelerator, folder, state)


if __name__ == "__main__":
    ppo_harness.run.save_checkpoint = save_checkpoint_where_replicas_agree  # what Run.checkpoint calls
    ppo.main(tyro.cli(ppo.Args))
