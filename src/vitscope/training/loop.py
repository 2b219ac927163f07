"""The training loop: a function with explicit inputs (a TrainConfig, a run directory) and outputs.

One process or many under torchrun (DistributedDataParallel). Every epoch's data order comes from
(seed, epoch) and every augmentation from one saved torch.Generator, so a run resumed from any
checkpoint ends with bit-identical weights to one that never stopped. In DDP every rank augments
the whole global batch with the same generator and trains on its slice, so N processes compute
exactly what one process does with the same global batch.

What is trained is a task (training/task.py): classification or captioning. The task builds the data
and the model, turns a batch into a loss, evaluates a split by its metric, says what a checkpoint carries
and writes the report; the loop is the same for every task.

A first SIGINT or SIGTERM stops a run within seconds: it abandons an evaluation under way, saves a
checkpoint and skips the final evaluation (a resumed run makes up an epoch's evaluation it missed). A
second signal leaves at once; the checkpoint the run last committed stays whole.

What the loop calls on has a file of its own: setup.py builds the task and the optimizer, checkpointing.py
writes a checkpoint as one unit and resume.py finds, checks and loads one, progress.py counts the run's
progress and shows it, stopping.py hears the signals.
"""

from __future__ import annotations

import json
import math
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import torch
from torch import Tensor, nn

from vitscope.errors import ConfigError
from vitscope.kernels import allocator
from vitscope.training import distributed
from vitscope.training.checkpointing import Checkpoint, CheckpointError, save_checkpoint
from vitscope.training.config import TrainConfig
from vitscope.training.evaluation import evaluate
from vitscope.training.probes import ProbeLog, write_probe_report
from vitscope.training.progress import Meter, Progress
from vitscope.training.resume import changed_since, find_checkpoint
from vitscope.training.run_dir import RunLock, check_target, take
from vitscope.training.setup import Setup, order_seed, pick_device, read_rows, restore, setup
from vitscope.training.stopping import Abandon, NonFiniteLoss, Stopper, non_finite
from vitscope.training.task import Evaluation, TrainResult
from vitscope.weights.model_io import save_model

# evaluate: the classifier's, for `vitscope eval` and the tests
__all__ = ["NonFiniteLoss", "TrainConfig", "TrainResult", "evaluate", "train"]


# -- pieces -----------------------------------------------------------------------------------------
def compile_options(device: torch.device) -> dict:
    """Inductor options for `--compile`. On a GPU, its coalesce tiling analysis off: torch 2.11's raised an
    AssertionError in it for ViT-S/16's training step (for timm-style ViTs generally, vit-pytorch's too);
    off, the step compiled and ran at 5,845 images/s against 3,042 eager on an H200 (benchmarks/RESULTS.md)."""
    import torch._inductor.config as inductor_config

    if device.type == "cuda" and hasattr(inductor_config.triton, "coalesce_tiling_analysis"):
        return {"triton.coalesce_tiling_analysis": False}
    return {}


def lr_at(step: int, total: int, warmup: int, cfg: TrainConfig) -> float:
    """Linear warm-up to cfg.lr, then cosine decay to cfg.min_lr."""
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    t = (step - warmup) / max(1, total - warmup)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * min(t, 1.0)))


def epoch_order(n: int, seed: int, epoch: int) -> Tensor:
    g = torch.Generator().manual_seed(order_seed(seed, epoch))
    return torch.randperm(n, generator=g)


def _ema_update(ema: nn.Module, model: nn.Module, decay: float) -> None:
    with torch.no_grad():
        e = [p for p in ema.state_dict().values() if p.dtype.is_floating_point]
        m = [p for p in model.state_dict().values() if p.dtype.is_floating_point]
        torch._foreach_lerp_(e, m, 1 - decay)


# -- the loop ---------------------------------------------------------------------------------------
def train(cfg: TrainConfig, run_dir: str | Path, *, resume: bool = False, overwrite: bool = False,
          weights_only: bool = False, progress: bool = True, max_steps: int | None = None,
          config_changes: bool = False) -> TrainResult:
    """Train `cfg` into `run_dir`; with `resume`, continue from run_dir's checkpoint.

    Nothing in `run_dir` changes until the data and the model are ready: a run that cannot start leaves it
    as it was. A directory holding a run is refused unless `resume` (continue it, bit-identically) or
    `overwrite` (replace it); `weights_only` resumes from the weights alone where the checkpoint is not one
    unit. `max_steps` stops after that many optimizer steps in total (tests use it to interrupt a run). A
    resumed run whose config differs from its checkpoint's is refused, naming the fields, unless
    `config_changes` (then it continues with the new values, and the curve is no longer the same run's).
    """
    run_dir = Path(run_dir)
    cfg.validate()  # a dataclass can be changed after it was made
    if weights_only and not resume:
        raise ConfigError("weights_only continues a run from its weights: use it with resume (--resume RUN_DIR)")
    if resume and overwrite:
        raise ConfigError("--resume continues a run and --overwrite replaces it: choose one")
    device = pick_device(cfg.device)
    info = distributed.setup(device)
    try:
        with ExitStack() as held:
            if info.is_main:
                check_target(run_dir, resume=resume, overwrite=overwrite)
                if resume:
                    held.enter_context(RunLock(run_dir))
            found = find_checkpoint(run_dir, weights_only=weights_only) if resume else None
            changed = changed_since(found, cfg) if found is not None and not config_changes else []
            if changed:
                raise ConfigError(f"{run_dir}/config.json differs from the config its checkpoint was trained with "
                                  f"in {', '.join(changed)}; put the values back to continue the same run, or pass "
                                  f"--config-changes to continue with the new ones")
            if cfg.threads:
                torch.set_num_threads(cfg.threads)
            if device.type == "cpu" and cfg.keep_freed_memory:
                allocator.keep_freed_memory()
            s = setup(cfg, device, resume=resume)
            if cfg.batch_size % info.world_size:
                raise ConfigError(f"batch_size {cfg.batch_size} must divide evenly over {info.world_size} processes")
            gen = torch.Generator().manual_seed(cfg.seed)
            at = restore(cfg, s, found, gen, run_dir, info)
            if info.is_main:
                take(run_dir, held, cfg.to_dict(), found, overwrite=overwrite)
                if found is not None:
                    print(f"resuming {run_dir} from {found.describe()}"
                          + (": the weights alone, optimizer and random state afresh" if found.state is None else ""),
                          flush=True)
            with Stopper(can_abandon=not info.enabled) as stopper:
                run = _Training(cfg, s, at, gen, run_dir, info, found, stopper, progress=progress)
                try:
                    stopped = run.loop(run.total if max_steps is None else min(run.total, max_steps))
                except BaseException:
                    run.meter.close()  # before the error's line is printed, so that line is the last one
                    raise
            return run.finish(stopped)
    finally:
        distributed.teardown(info)


class _Training:
    """One run of the loop: a training step, an evaluation and a checkpoint are each a method."""

    def __init__(self, cfg: TrainConfig, s: Setup, at: Progress, gen: torch.Generator, run_dir: Path,
                 info: distributed.DistInfo, found: Checkpoint | None, stopper: Stopper, *, progress: bool):
        self.cfg, self.s, self.task, self.at, self.gen, self.run_dir, self.info = cfg, s, s.task, at, gen, run_dir, info
        self.stopper = stopper
        self.steps_per_epoch = self.task.train_size // cfg.batch_size
        self.total = self.steps_per_epoch * cfg.epochs
        self.warmup = max(1, int(cfg.warmup_epochs * self.steps_per_epoch))
        self.rows = slice(info.rank * cfg.batch_size // info.world_size,
                          (info.rank + 1) * cfg.batch_size // info.world_size)  # this rank's part of a batch
        self.net = self.task.train_module  # the model itself for a classifier; for a captioner, its loss as one module
        if info.enabled:
            self.net = nn.parallel.DistributedDataParallel(
                self.net, device_ids=[s.device.index] if s.device.type == "cuda" else None)
        if cfg.compile:
            self.net = torch.compile(self.net, options=compile_options(s.device))
        self.meta = {"train_config": json.dumps(cfg.to_dict()), **self.task.metadata()}
        self.last = found if found is not None and found.state is not None else None  # the checkpoint in force
        self.last_save_t = time.monotonic()
        self.ev: Evaluation | None = None  # the latest evaluation, made at step self.ev_step
        self.ev_step = -1
        self.meter = Meter(at, self.task, cfg, run_dir, total=self.total, steps_per_epoch=self.steps_per_epoch,
                           show=progress, main=info.is_main)
        self.probes = self.open_probes(found)

    # -- probes: the attention of a few fixed inputs at every evaluation ------------------------------------------
    def open_probes(self, found: Checkpoint | None) -> ProbeLog | None:
        """The run's probes file (the main process's), taken up where a resumed run's checkpoint left it."""
        ask = getattr(self.task, "probe_header", None)
        header = ask() if ask is not None and self.info.is_main else None
        if header is None:
            return None
        log = ProbeLog(self.run_dir, *header)
        if found is not None:
            log.load(found.step)
        return log

    def probe(self, epoch: float) -> None:
        """Keep the probed inputs' attention at this step (the EMA weights where the run keeps them); step 0's is
        written with the first evaluation's or checkpoint."""
        if self.probes is not None and not self.probes.has(self.at.step):
            self.probes.record(self.at.step, epoch, self.task.probe(self.s.ema or self.s.model, device=self.s.device,
                                                                    bf16=self.s.bf16), write=self.at.step > 0)

    # -- one step, one evaluation ---------------------------------------------------------------------------
    def step(self, idx: Tensor, epoch: int) -> None:
        """One optimizer step on the global batch `idx` (this rank trains on its rows)."""
        s, at = self.s, self.at
        batch = self.task.batch(idx, self.gen)  # the whole global batch, augmented
        for g in s.optimizer.param_groups:
            g["lr"] = lr_at(at.step, self.total, self.warmup, self.cfg)
        loss, stats = self.task.loss(self.net, batch, self.rows, s.device, s.bf16)
        if not torch.isfinite(loss):
            self.meter.close()
            raise NonFiniteLoss(non_finite(loss.item(), at.step, epoch, self.cfg, self.run_dir, self.last))
        s.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if self.cfg.clip_grad:
            nn.utils.clip_grad_norm_(s.model.parameters(), self.cfg.clip_grad)
        s.optimizer.step()
        if s.ema is not None:
            _ema_update(s.ema, s.model, self.cfg.ema_decay)
        at.step += 1
        at.epoch_loss_sum += stats.loss_sum
        at.epoch_correct += stats.correct
        at.epoch_count += stats.count
        at.seen += stats.samples * self.info.world_size

    def evaluate(self, *, final: bool = False) -> Evaluation | None:
        """The task's evaluation of the EMA weights (else the model's); None when a signal abandoned it."""
        self.stopper.abortable = True
        try:
            return self.task.evaluate(self.s.ema or self.s.model, device=self.s.device, bf16=self.s.bf16,
                                      info=self.info, final=final)
        except Abandon:
            return None
        finally:
            self.stopper.abortable = False
            self.meter.after_evaluation()

    def evaluate_and_log(self, epoch: float) -> bool:
        """Evaluate, write the metrics row (`epoch` is fractional inside an epoch: --eval-every-steps) and keep
        the best weights. False when a signal abandoned the evaluation."""
        at = self.at
        ev = self.evaluate()
        if ev is None:
            return False
        self.ev, self.ev_step = ev, at.step
        self.probe(epoch)
        self.meter.record(epoch, lr_at(at.step - 1, self.total, self.warmup, self.cfg), ev)
        # the first evaluation's weights are the best so far even at a metric of 0 (a caption run's first epoch)
        if ev.value > at.best_metric or not (self.run_dir / "best.safetensors").exists():
            at.best_metric = max(at.best_metric, ev.value)
            self.save_best()
        return True

    def end_epoch(self, epoch: int) -> bool:
        """The epoch's evaluation, then its running figures start afresh; False when a signal abandoned it
        (the checkpoint then keeps the figures, and a resumed run evaluates the epoch first)."""
        if not self.evaluate_and_log(epoch):
            return False
        self.at.epoch_loss_sum, self.at.epoch_correct, self.at.epoch_count = 0.0, 0, 0
        return True

    # -- checkpoints ----------------------------------------------------------------------------------------
    def save_best(self) -> None:
        if not self.info.is_main:
            return
        try:
            save_model(self.s.model, self.run_dir / "best.safetensors",
                       metadata={**self.meta, "step": str(self.at.step)})
        except OSError as e:
            kept = (f"the checkpoint of step {self.last.step} is kept" if self.last is not None
                    else "no checkpoint was written yet")
            raise CheckpointError(f"could not write {self.run_dir / 'best.safetensors'}: {e.strerror or e}; {kept}. "
                                  f"Free some space or raise the limit, then {self._again()}") from e

    def _again(self) -> str:
        """How to go on after a failed write: resume where a checkpoint exists, else start the run afresh."""
        if self.last is not None:
            return f"continue with: vitscope train --resume {self.run_dir}"
        return f"train again (with --overwrite to reuse {self.run_dir})"

    def save_last(self) -> None:
        if not self.info.is_main or (self.last is not None and self.last.step == self.at.step):
            return  # this step is saved already
        s = self.s
        state = {"optimizer": s.optimizer.state_dict(), "generator": self.gen.get_state(),
                 "torch_rng": torch.get_rng_state(), **self.at.to_state()}
        if self.probes is not None:  # before the checkpoint: a resumed run finds every probe up to its step
            self.probes.flush()
        self.last = save_checkpoint(self.run_dir, self.at.step, model=s.model, ema=s.ema, state=state,
                                    metadata=self.meta, previous=self.last)
        self.last_save_t = time.monotonic()

    def due(self) -> bool:
        """A checkpoint inside the epoch, every --checkpoint-every-steps steps or minutes."""
        n, minutes = self.cfg.checkpoint_every_steps, self.cfg.checkpoint_every_minutes
        late = bool(minutes and time.monotonic() - self.last_save_t >= 60 * minutes)
        return bool(n and self.at.step % n == 0) or late

    # -- the epochs -----------------------------------------------------------------------------------------
    def loop(self, end: int) -> str:
        """Train to step `end`; "finished", or "signal" when one stopped the run (its checkpoint saved)."""
        at, spe, cfg = self.at, self.steps_per_epoch, self.cfg
        if at.step == 0:
            self.probe(0)  # the attention before any training: where the curves start
        if at.step % spe == 0 and at.epoch_count and not self.make_up_epoch_end():
            return self.stop()
        while at.step < end:
            epoch, first = divmod(at.step, spe)
            order = epoch_order(self.task.train_size, cfg.seed, epoch)
            self.s.model.train()
            t0 = self.meter.clock()
            for i in range(first, min(spe, first + end - at.step)):
                self.step(order[i * cfg.batch_size : (i + 1) * cfg.batch_size], epoch)
                self.meter.show_step(epoch, i, t0)
                if distributed.any_flag(self.stopper.signal is not None, self.info):
                    self.meter.charge(t0)
                    return self.stop()
                inside = i < spe - 1 and at.step < end
                if inside and cfg.eval_every_steps and at.step % cfg.eval_every_steps == 0:
                    self.meter.charge(t0)
                    if not self.evaluate_and_log(round(at.step / spe, 4)):
                        return self.stop()
                    self.s.model.train()
                    t0 = self.meter.clock()
                if inside and self.due():
                    self.meter.charge(t0)
                    t0 = self.meter.clock()
                    self.save_last()
            self.meter.charge(t0)
            if at.step % spe:  # max_steps inside the epoch
                break
            if not self.end_epoch(epoch + 1):
                return self.stop()
            self.save_last()
        self.save_last()
        return "finished"

    def make_up_epoch_end(self) -> bool:
        """A run stopped by a signal at an epoch's end left that epoch unevaluated, its running figures kept:
        evaluate it now (False when a signal abandons that too). Its row may be logged already, by a resumed
        run killed before its next checkpoint: then the figures alone start afresh."""
        if any(r.get("step") == self.at.step for r in read_rows(self.run_dir / "metrics.jsonl")):
            self.at.epoch_loss_sum, self.at.epoch_correct, self.at.epoch_count = 0.0, 0, 0
            return True
        return self.end_epoch(self.at.step // self.steps_per_epoch)

    def stop(self) -> str:
        """A signal: save the checkpoint and leave, the final evaluation skipped."""
        self.save_last()
        self.meter.close()
        if self.info.is_main:  # one line on stderr, as every other way a run ends early says itself
            print(f"{self.stopper.signal}: stopped by the signal at step {self.at.step}, its checkpoint saved; the "
                  f"final evaluation skipped. Continue with: vitscope train --resume {self.run_dir}",
                  file=sys.stderr, flush=True)
        return "signal"

    def finish(self, stopped: str) -> TrainResult:
        """The final evaluation (the last one's where it is the same), the result and the task's report."""
        self.meter.close()
        at, metric = self.at, self.task.metric
        final = None
        if stopped == "finished" and self.stopper.signal is None:
            same = self.ev_step == at.step and not self.task.final_reevaluates
            final = self.ev if same else self.evaluate(final=True)
        if final is None and stopped == "finished":  # a signal came after the last step
            stopped = self.stop()
        value = final.value if final is not None else None
        best = at.best_metric if value is None else max(at.best_metric, value)
        result = TrainResult(self.run_dir, metric, value, best, at.train_time_s,
                             at.seen / max(at.train_time_s, 1e-9) if at.seen else 0.0, self.task.unit, stopped)
        if self.info.is_main and final is not None and at.step >= self.total:
            try:
                self.task.report(self.run_dir, self.s.model, result, final)
                if self.probes is not None:
                    write_probe_report(self.run_dir)
            except OSError as e:  # the run itself is whole: say which file, and how to write the report again
                kept = f"the checkpoint of step {self.last.step} is kept" if self.last is not None else "no checkpoint"
                raise CheckpointError(f"could not write the run's report: {e.strerror or e} ({e.filename}); {kept}. "
                                      f"The trained weights are whole: free some space, and vitscope eval "
                                      f"{self.run_dir} reports them") from e
        return result
