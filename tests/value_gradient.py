"""The value loss's gradient on data-parallel processes (run by tests/test_critic.py through `accelerate launch`):
each process holds its share of one minibatch's rows and steps through them in --gradient-accumulation-steps
micro-batches through `ppo.ppo_loss` (the value loss alone), `accelerator.accumulate` and `accelerator.backward`
(DDP averages the processes' gradients); the main process compares the value head's gradient with the gradient of
the whole minibatch as one micro-batch on one process, in float64, and prints AGREE. The token-level loss's
denominators are `ppo.loss_denominators`', reduced over the processes as in a run.

    accelerate launch --config_file accelerate_configs/multi_cpu.yaml --num_processes 2 tests/value_gradient.py \\
        --aggregation token --accumulation 4
"""
import argparse
import sys
from pathlib import Path

import torch
from accelerate import Accelerator

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import ppo  # noqa: E402

N, T, HIDDEN = 16, 5, 4  # rows of the minibatch (over all processes), response positions, hidden size


class Critic(torch.nn.Module):
    """The training forward's shape (log-probs, entropies, values) with a value head on fixed hidden states; the
    rows' indices ride in the first column of query_responses."""

    def __init__(self, states: torch.Tensor):
        super().__init__()
        torch.manual_seed(0)
        self.head = torch.nn.Linear(HIDDEN, 1).double()
        self.states = states

    def forward(self, query_responses, pad_token_id, context_length, response_ids, temperature, trunks=None):
        rows = query_responses[:, 0]
        zeros = torch.zeros(len(rows), T, dtype=torch.float64)
        return zeros, zeros, self.head(self.states[rows]).squeeze(-1)


def rollout(rows: torch.Tensor, values, returns, mask) -> ppo.Rollout:
    n, zeros = len(rows), torch.zeros(len(rows), T, dtype=torch.float64)
    return ppo.Rollout(
        query_responses=torch.cat([rows[:, None], torch.zeros(n, T, dtype=torch.long)], 1),
        response_ids=torch.zeros(n, T, dtype=torch.long), trunks={}, responses=torch.zeros(n, T, dtype=torch.long),
        sequence_lengths=torch.full((n,), 3), padding_mask=mask[rows], padding_mask_p1=torch.zeros_like(mask[rows]),
        logprobs=zeros, ref_logprobs=zeros, values=values[rows], kl=zeros, non_score_reward=zeros, rewards=zeros,
        advantages=zeros, returns=returns[rows], scores=zeros[:, 0], trained_scores=zeros[:, 0],
        contain_eos_token=None, score_components={}, dropped=torch.zeros(n, dtype=torch.bool),
        positive=torch.zeros_like(mask[rows]))


def head_gradient(model) -> torch.Tensor:
    head = model.module.head if hasattr(model, "module") else model.head
    return torch.cat([head.weight.grad.flatten(), head.bias.grad])


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--aggregation", default="micro-batch")
    parser.add_argument("--accumulation", type=int, default=4)
    flags, _ = parser.parse_known_args()  # launch() adds --output-dir
    accelerator = Accelerator(gradient_accumulation_steps=flags.accumulation)
    g = torch.Generator().manual_seed(1)  # the same data on every process
    states = torch.randn(N, T, HIDDEN, dtype=torch.float64, generator=g)
    values, returns = (torch.randn(N, T, dtype=torch.float64, generator=g) for _ in range(2))
    mask = torch.zeros(N, T, dtype=torch.bool)
    mask[:, 4:] = True  # every response 4 tokens long: the micro-batch means weigh each alike
    share = N // accelerator.num_processes
    args = ppo.Args(loss_aggregation=flags.aggregation, cliprange_value=0.2, num_mini_batches=1,
                    gradient_accumulation_steps=flags.accumulation, per_device_train_batch_size=share // flags.accumulation)
    mine = torch.arange(N)[accelerator.process_index * share:(accelerator.process_index + 1) * share]
    r = rollout(mine, values, returns, mask)
    model = accelerator.prepare(Critic(states))
    local = torch.arange(share)
    denominators = None if flags.aggregation == "micro-batch" else ppo.loss_denominators(accelerator, args, r, local)
    for rows in local.split(args.per_device_train_batch_size):
        with accelerator.accumulate(model):
            loss, _ = ppo.ppo_loss(model, rows, r, args, 0, False, None if denominators is None else denominators[0])
            accelerator.backward(loss)
    if accelerator.is_main_process:
        whole, everything = Critic(states), torch.arange(N)
        one = ppo.Args(loss_aggregation=flags.aggregation, cliprange_value=0.2, num_mini_batches=1,
                       gradient_accumulation_steps=1, per_device_train_batch_size=N)
        # one process, one micro-batch: the whole minibatch's token count, undivided
        counts = (None if flags.aggregation == "micro-batch"
                  else torch.tensor([float((~mask).sum()), 1.0], dtype=torch.float64))
        loss, _ = ppo.ppo_loss(whole, everything, rollout(everything, values, returns, mask), one, 0, False, counts)
        loss.backward()
        torch.testing.assert_close(head_gradient(model), head_gradient(whole), rtol=1e-12, atol=1e-14)
        assert head_gradient(whole).abs().sum() > 0
        print(f"AGREE: {accelerator.num_processes} processes x {flags.accumulation} micro-batches, {flags.aggregation}")
