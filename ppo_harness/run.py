"""The plumbing around `main`'s loop, the same for both scripts (their TRY NOT TO MODIFY blocks):
`start_run` resumes a checkpoint's weights, optimizer and random states, opens the logs, installs
the SIGTERM handler and prints the banner; `Run.log_update` writes an update's metrics;
`Run.checkpoint` saves the models and a checkpoint when due; `Run.finish` closes the run. The
algorithm's state kept across updates is the script's: it passes it to `Run.checkpoint` and reads it
back from `Run.saved`."""
import math
import time
from dataclasses import dataclass

from rich.console import Console

from ppo_harness.checkpoints import save_checkpoint
from ppo_harness.hub import push_checkpoint, push_run
from ppo_harness.preemption import Preemption
from ppo_harness.run_folder import RunFolder
from ppo_harness.run_log import RunLog, print_banner
from ppo_harness.saved_models import save_models
from ppo_harness.speed import CompileWatch


@dataclass
class Run:
    """One run's plumbing, as `start_run` set it up."""
    accelerator: object
    args: object
    folder: RunFolder
    log: RunLog
    # SIGTERM, SIGINT: the update in progress finishes, is checkpointed, and the run stops
    preemption: Preemption
    compile_watch: CompileWatch
    console: Console
    start_update: int  # 1, or the update after the resumed checkpoint's
    # the resumed checkpoint's state, as the script passed it to `checkpoint` (None: a new run)
    saved: dict | None
    # what every checkpoint records and a resume must match (the batch arithmetic, the data's size)
    run_state: dict
    base_model_path: str  # the SFT model, whose tokenizer and config the saved policy carries
    batch_size: int
    start_time: float = 0.0

    def log_update(self, update: int, metrics: dict, samples: list[dict] = (), training_seconds: float = 0.0):
        """An update's metrics (with `eps`, episodes per second since the loop began; a metric that
        is not finite, or an update --dynamic-sampling left empty, stops the run) and a few of its
        rollout's rows; what torch.compile compiled
        during it, on the console."""
        if not all(math.isfinite(v) for v in metrics.values()):
            raise FloatingPointError(f"update {update}: non-finite metrics {metrics}")
        # as an update no reward judged (reward_calls.no_row_judged): one that trained on nothing stops the run
        if metrics.get("val/dynamic_sampling_dropped") == 1.0:
            raise ValueError(
                f"update {update}: every group of --num-generations responses scored alike, so "
                "--dynamic-sampling left every response out of the loss and the update trained on "
                "nothing (val/dynamic_sampling_dropped 1.0). The reward cannot tell one prompt's "
                "responses apart (a constant reward? every answer right or every one wrong?): try it "
                "on a few responses, raise --num-generations, or drop --dynamic-sampling")
        eps = (update - self.start_update + 1) * self.batch_size / (time.time() - self.start_time)
        self.log.log(update, {**metrics, "eps": round(eps, 3)}, samples)
        self.compile_watch.report(update, training_seconds, self.console if self.accelerator.is_main_process
                                  else None)

    def checkpoint(self, model, update: int, episode: int, last: bool, lr: float, state: dict) -> bool:
        """Phase 8: the models at the end (not with --no-save-at-end), a checkpoint every
        --save-every updates, at the end and on SIGTERM or SIGINT, carrying `state`; whether the run
        must stop now (a signal came)."""
        stopping = self.preemption.requested(self.accelerator)
        at_end = last and self.args.save_at_end
        if at_end:
            save_models(self.accelerator, model, self.args, self.base_model_path, self.folder.path, self.console)
        if at_end or stopping or (self.args.save_every > 0 and update % self.args.save_every == 0):
            save_checkpoint(self.accelerator, self.folder, dict(update=update, episode=episode, finished=last, lr=lr,
                                                                **state, **self.run_state))
            if (getattr(self.args, "push_to_hub", False) and self.args.hub_strategy == "all_checkpoints"
                    and self.accelerator.is_main_process):
                push_checkpoint(self.args, self.folder.checkpoints / f"update-{update:06d}", self.folder.run_name,
                                self.console)
        self.log.progress.update(self.log.task, advance=1)
        return stopping

    def finish(self, update: int, last: bool, stopping: bool) -> None:
        """The logs closed; a finished run pushed to the Hub (--push-to-hub); every process leaves
        together (one that exits while gloo or NCCL threads run can abort); a run stopped by a
        signal exits with code 143, naming its checkpoint."""
        self.log.close()
        if last and getattr(self.args, "push_to_hub", False) and self.accelerator.is_main_process:
            push_run(self.args, self.folder.path, self.folder.run_name, self.console)
        self.accelerator.wait_for_everyone()
        self.accelerator.end_training()
        if stopping and not last:
            self.preemption.exit(self.console, update, self.folder.checkpoints)


def start_run(accelerator, args, setup, optimizer, models: dict, notes: list[str], base_model_path: str) -> Run:
    """A resumed checkpoint's weights, optimizer and every rank's random states, as they were after
    its update (the flags' lr, betas... kept: a changed one is used); the logs (a resume drops the
    rows of the updates it redoes); the SIGTERM handler; the banner (the batch arithmetic, `notes`,
    each model in `models` and its memory). Call it after seeding: a resume restores the random
    states the seeds set."""
    folder, console, start_update = setup.folder, Console(), 1
    if folder.checkpoint is not None:
        settings = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
        accelerator.load_state(str(folder.checkpoint))
        for group, flags in zip(optimizer.param_groups, settings):
            group.update(flags)
        start_update = folder.saved["update"] + 1
        if accelerator.is_main_process:
            console.print(f"resumed from {folder.checkpoint}: continuing at update {start_update}")
    run_log = RunLog(args, accelerator, folder, setup.sizes.num_updates, start_update, console)
    run = Run(accelerator, args, folder, run_log, Preemption(folder.checkpoints), CompileWatch(), console,
              start_update, folder.saved if folder.checkpoint is not None else None, setup.run_state,
              base_model_path, setup.sizes.batch_size)
    if accelerator.is_main_process:
        plugin = accelerator.state.deepspeed_plugin
        print_banner(console, folder.run_name, args, setup.sizes, models, plugin.zero_stage if plugin else 0,
                     [*notes, *folder.banner_lines()])
    run.start_time = time.time()
    run_log.progress.start()
    return run
