"""What a run reports: the banner at its start (the batch arithmetic and each model's memory), then
per update a line in metrics.jsonl, TensorBoard's points (CleanRL's logging; wandb syncs them with
--track), a console line and the progress bar, all on the main process."""
import json
import time
from dataclasses import asdict

import psutil
import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table
from torch.utils.tensorboard import SummaryWriter

from ppo_harness.log_files import LOGS, keep_rows_before
from ppo_harness.run_folder import RunFolder, write_args

# those a run logs, on its console line
CONSOLE_METRICS = ("objective/scores", "objective/kl", "objective/rlhf_reward", "policy/approxkl_avg", "val/ratio",
                   "eval/scores", "eval/kl", "objective/validation_score")


def print_rows(console, rows: list[dict], title: str, omit: tuple = (), cut: dict[str, int] | None = None) -> None:
    """Rows as a console table, a column for every key but `omit`'s (one a script adds is shown
    too): a float to 4 decimals, a text longer than `cut[column]` characters cut short."""
    columns, cut = [k for k in rows[0] if k not in omit], cut or {}
    table = Table(*columns, title=title, show_lines=True)
    for row in rows:
        cells = {k: f"{row[k]:.4f}" if isinstance(row[k], float) else str(row[k]) for k in columns}
        table.add_row(*(c if len(c) <= cut.get(k, len(c)) else c[:cut[k]] + " [...]" for k, c in cells.items()))
    console.print(table)


class RunLog:
    """metrics.jsonl, TensorBoard (CleanRL), wandb with --track, a progress bar and a console line
    (main process). Opening it writes args.json and drops the logs' rows of the updates a resumed
    run redoes."""

    def __init__(self, args, accelerator, folder: RunFolder, num_updates: int, start_update: int, console):
        # start-up: from the process's start to here (imports, set-up, models, checks, the sampler's
        # compilation), logged as time/startup with the first update
        self.startup = time.time() - psutil.Process().create_time()
        self.main_process, self.track, self.num_updates = accelerator.is_main_process, args.track, num_updates
        self.folder, self.console = folder.path, console
        self.progress = Progress(TextColumn("[progress.description]{task.description}"), BarColumn(),
                                 MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn(), console=console,
                                 disable=not self.main_process)
        self.task = self.progress.add_task("PPO "
                                           "updates", total=num_updates, completed=start_update - 1)
        if not self.main_process:
            return
        write_args(folder.path, args, folder.run_name, folder.changes, start_update)
        # a run started over logs its update 0 again
        first = start_update if start_update > 1 else 0
        for log in LOGS:
            keep_rows_before(folder.path / log, first)
        self.metrics_file = open(folder.path / "metrics.jsonl", "a")
        if args.track:
            import wandb

            wandb.init(project=args.wandb_project_name, entity=args.wandb_entity, config=asdict(args),
                       name=folder.run_name, sync_tensorboard=True, save_code=True)
        # TensorBoard drops the points of the updates a resumed run redoes
        self.writer = SummaryWriter(str(folder.path), purge_step=first)
        self.writer.add_text("hyperparameters", "|param|value|\n|-|-|\n" + "\n".join(
            f"|{k}|{v}|" for k, v in asdict(args).items()))

    def log(self, update: int, metrics: dict, samples: list[dict] = ()) -> None:
        """An update's metrics, and `samples` (a few of its rollout's rows) into
        training_samples.jsonl."""
        if update > 0 and self.startup is not None:
            metrics, self.startup = {**metrics, "time/startup": self.startup}, None
        if not self.main_process:
            return
        self.metrics_file.write(json.dumps({"update": update, **metrics}) + "\n")
        self.metrics_file.flush()
        if samples:
            with open(self.folder / "training_samples.jsonl", "a") as f:
                f.writelines(json.dumps({"update": update, **row}, default=str) + "\n" for row in samples)
        for k, v in metrics.items():
            self.writer.add_scalar(k, v, update)
        self.progress.console.print(f"update {update}/{self.num_updates}  " + "  ".join(
            f"{k.replace('eval/', 'eval_').split('/')[-1]}={metrics[k]:.4g}" for k in CONSOLE_METRICS if k in metrics))

    def samples(self, update: int, rows: list[dict], title: str, shown: int = 5) -> None:
        """Held-out samples: every row to samples.jsonl (and wandb with --track), the first `shown`
        on the console without their rendered "query" (their "prompt" is the dataset's)."""
        if not self.main_process or not rows:
            return
        print_rows(self.console, rows[:shown], title, omit=("query",))
        with open(self.folder / "samples.jsonl", "a") as f:
            f.writelines(json.dumps({"update": update, **row}, default=str) + "\n" for row in rows)
        self.table("samples", rows)

    def table(self, name: str, rows: list[dict]) -> None:
        """A table of rows (held-out samples) to wandb with --track."""
        if self.main_process and self.track and rows:
            import wandb

            wandb.log({name: wandb.Table(columns=list(rows[0]), data=[list(r.values()) for r in rows])})

    def close(self) -> None:
        self.progress.stop()
        if self.main_process:
            self.metrics_file.close()
            self.writer.close()
            if self.track:
                import wandb

                wandb.finish()


def print_banner(console, run_name: str, args, sizes, models: dict, zero_stage: int, notes: list[str]) -> None:
    """The batch arithmetic, `notes`, and per model an estimate of its memory on each process
    (weights, and gradients + AdamW moments when trained; ZeRO-2 shards the latter, ZeRO-3 all)."""
    steps = args.num_ppo_epochs * args.num_mini_batches
    console.print(f"[bold]{run_name}[/bold]\n  processes {sizes.world_size}; per update "
                  f"{sizes.batch_size} responses ({sizes.local_batch_size} per process); "
                  f"minibatch {sizes.mini_batch_size} ({sizes.local_mini_batch_size} per process) "
                  f"= {args.gradient_accumulation_steps} accumulated micro-batch(es) of "
                  f"{args.per_device_train_batch_size}\n  {steps} optimizer steps per update "
                  f"({args.num_ppo_epochs} epochs x {args.num_mini_batches} minibatches); "
                  f"{sizes.num_updates} updates for {args.total_episodes} episodes")
    for note in notes:
        console.print(f"  {note}", highlight=False, markup=False)
    table = Table("model", "dtype", "parameters", "trainable", "memory estimate per process")
    for name, model in models.items():
        if model is None:
            continue
        params = [(getattr(p, "ds_numel", p.numel()), p.element_size(), p.requires_grad) for p in model.parameters()]
        weights = sum(n * size for n, size, _ in params) / (sizes.world_size if zero_stage == 3 else 1)
        # gradient + fp32 Adam moments
        training = sum(n * (size + 8) for n, size, trains in params if trains)
        training /= sizes.world_size if zero_stage >= 2 else 1
        table.add_row(name, str(next(model.parameters()).dtype).removeprefix("torch."),
                      f"{sum(n for n, _, _ in params) / 1e6:.1f}M",
                      f"{sum(n for n, _, trains in params if trains) / 1e6:.1f}M",
                      f"{(weights + training) / 2**30:.2f} GiB")
    console.print(table)


def check_finite_losses(accelerator, losses: list, update: int, checkpoints) -> None:
    """Stop every process together if some micro-batch's loss was not finite, naming the first.
    `losses`: (loss, epoch, minibatch) of each micro-batch of the PPO epochs (ppo.py's epochs after
    --num-ppo-epochs are --critic-epochs'), read here once per update, after them: a read per step
    would make the host wait for the GPU at every step. The update's weights are not saved: the last
    good checkpoint stays."""
    if not losses:
        return
    bad = ~torch.isfinite(torch.stack([loss.detach().float() for loss, *_ in losses]))
    # 1 + the first bad micro-batch's index, or 0
    first = torch.where(bad.any(), bad.float().argmax() + 1, 0)
    first = [f for f in accelerator.gather(first[None]).tolist() if f > 0]
    if first:
        _, epoch, minibatch = losses[min(first) - 1]
        raise FloatingPointError(f"update {update} (epoch {epoch}, minibatch {minibatch}): non-finite "
                                 "loss on some rank; the last good checkpoint is "
                                 f"kept in {checkpoints}")


def lr_outside_schedule(group: dict) -> str:
    """Why a run stops at an lr written into an optimizer group outside the script's schedule."""
    return (f"the optimizer group {group.get('name', '?')!r} has lr {group['lr']}, written outside the script's "
            f"schedule, which sets every group's lr each update from its 'initial_lr' ({group['initial_lr']}) "
            "and would overwrite it: set group['initial_lr'] to the starting lr you want (the critic's: "
            "--critic-learning-rate), or change the schedule itself")
