"""The training loop: a function with explicit inputs (a TrainConfig, a run directory) and outputs.

One process or many under torchrun (DistributedDataParallel). Every epoch's data order comes from
(seed, epoch) and every augmentation from one saved torch.Generator, so a run resumed from any
checkpoint ends with bit-identical weights to one that never stopped. In DDP every rank augments
the whole global batch with the same generator and trains on its slice, so N processes compute
exactly what one process does with the same global batch.

What is trained is a task (training/tasks.py): classification, or captioning (vitscope.caption). The
task builds the data and the model, turns a batch into a loss, evaluates a split and says what a
checkpoint carries; the loop is the same for both.
"""

from __future__ import annotations

import copy
import json
import math
import signal
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm.auto import tqdm

from vitscope import kernels
from vitscope.errors import ConfigError
from vitscope.kernels import allocator, bf16
from vitscope.training import distributed as D
from vitscope.training.checkpointing import (
    Checkpoint,
    Progress,
    find_checkpoint,
    load_checkpoint,
    load_weights_alone,
    save_checkpoint,
)
from vitscope.training.config import TrainConfig
from vitscope.training.evaluation import evaluate
from vitscope.training.optim import build_optimizer
from vitscope.training.run_dir import RunLock, check_target, take
from vitscope.training.tasks import Task, build_task
from vitscope.weights.checkpoints import save_model

__all__ = ["NonFiniteLoss", "TrainConfig", "TrainResult", "evaluate", "train"]


class NonFiniteLoss(RuntimeError):
    pass


@dataclass
class TrainResult:
    run_dir: Path
    test_acc: float
    best_acc: float
    train_time_s: float
    images_per_s: float
    stopped: str = "finished"  # "finished" | "signal"


# -- pieces -----------------------------------------------------------------------------------------
def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise ConfigError(f"device {name!r} is not a device torch knows ({e}); use auto, cpu, cuda or cuda:N") from e
    if device.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch is a CPU build" if torch.version.cuda is None else "torch finds no CUDA GPU"
            raise ConfigError(f"device {name!r}: {why}; train with --device cpu (or auto)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(f"device {name!r}: there are {torch.cuda.device_count()} CUDA GPUs, numbered from 0")
    return device


def compile_options(device: torch.device) -> dict:
    """Inductor options for `--compile`. On a GPU, its coalesce tiling analysis off: torch 2.11's raised an
    AssertionError in it for ViT-S/16's training step (for timm-style ViTs generally, vit-pytorch's too);
    off, the step compiled and ran at 5,845 images/s against 3,042 eager on an H200 (benchmarks/RESULTS.md)."""
    import torch._inductor.config as inductor_config

    if device.type == "cuda" and hasattr(inductor_config.triton, "coalesce_tiling_analysis"):
        return {"triton.coalesce_tiling_analysis": False}
    return {}


def use_bf16(amp: str, device: torch.device) -> bool:
    if amp != "auto":
        return amp == "bf16"
    # GPUs with bf16 and AVX-512 CPUs run bf16 matmuls natively; elsewhere bf16 is emulated and slow.
    return bf16.native_matmul(device)


def lr_at(step: int, total: int, warmup: int, cfg: TrainConfig) -> float:
    """Linear warm-up to cfg.lr, then cosine decay to cfg.min_lr."""
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    t = (step - warmup) / max(1, total - warmup)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * min(t, 1.0)))


def soft_cross_entropy(logits: Tensor, target: Tensor) -> Tensor:
    return torch.sum(-target * F.log_softmax(logits.float(), dim=-1), dim=-1).mean()


def epoch_order(n: int, seed: int, epoch: int) -> Tensor:
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=g)


class _Stopper:
    """SIGINT/SIGTERM raise a flag; the loop saves a checkpoint at the next step and exits."""

    def __init__(self):
        self.flag = False
        self._old = {}

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread
                pass
        return self

    def _handle(self, signum, frame):
        self.flag = True

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)


def _ema_update(ema: nn.Module, model: nn.Module, decay: float) -> None:
    with torch.no_grad():
        e = [p for p in ema.state_dict().values() if p.dtype.is_floating_point]
        m = [p for p in model.state_dict().values() if p.dtype.is_floating_point]
        torch._foreach_lerp_(e, m, 1 - decay)


# -- setting up ---------------------------------------------------------------------------------
@dataclass
class Setup:
    """What a training needs besides its config: the task (its data and model), built before the run
    directory is touched."""

    task: Task
    model: nn.Module
    ema: nn.Module | None
    optimizer: torch.optim.Optimizer
    device: torch.device
    bf16: bool


def _setup(cfg: TrainConfig, device: torch.device, *, resume: bool) -> Setup:
    # the loss and the evaluation are looked up here, at the start of a run, so a test can stand in for them
    task = build_task(cfg, resume=resume, criterion=soft_cross_entropy, evaluator=evaluate)
    model = task.model
    model.to(device)
    if cfg.kernels and device.type == "cpu":
        kernels.apply(model)
    ema = copy.deepcopy(model).eval() if cfg.ema_decay else None
    for p in ema.parameters() if ema else []:
        p.requires_grad_(False)
    opt = build_optimizer(cfg.optimizer, model, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=cfg.betas,
                          device=device)
    return Setup(task, model, ema, opt, device, use_bf16(cfg.amp, device))


def _restore(cfg: TrainConfig, s: Setup, found: Checkpoint | None, gen: torch.Generator, run_dir: Path,
             info: D.DistInfo) -> Progress:
    """The run's progress after loading `found` into the model, optimizer and generators (a fresh start
    without it). Weights alone (a state-less checkpoint) restart the optimizer and the generators at its step."""
    if found is None:
        torch.manual_seed(cfg.seed + 7919 * (info.rank + 1))  # dropout and drop-path differ per rank
        return Progress()
    if found.state is not None:
        state = load_checkpoint(found, model=s.model, ema=s.ema, optimizer=s.optimizer, generator=gen)
        return Progress.from_state(state)
    load_weights_alone(found, model=s.model, ema=s.ema)
    gen.manual_seed(cfg.seed * 1_000_003 + found.step)
    torch.manual_seed(cfg.seed + found.step + 7919 * (info.rank + 1))
    rows = [r for r in read_rows(run_dir / "metrics.jsonl") if r.get("step", 0) <= found.step]
    return Progress(step=found.step, best_acc=max((r.get("test_acc", 0.0) for r in rows), default=0.0),
                    train_time_s=rows[-1].get("train_time_s", 0.0) if rows else 0.0,
                    seen=found.step * cfg.batch_size)


def read_rows(path: Path) -> list[dict]:
    rows = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            rows.append(json.loads(line))
        except ValueError:
            pass
    return [r for r in rows if isinstance(r, dict)]


# -- the loop ---------------------------------------------------------------------------------------
def train(cfg: TrainConfig, run_dir: str | Path, *, resume: bool = False, overwrite: bool = False,
          weights_only: bool = False, progress: bool = True, max_steps: int | None = None) -> TrainResult:
    """Train `cfg` into `run_dir`; with `resume`, continue from run_dir's checkpoint.

    Nothing in `run_dir` changes until the data and the model are ready: a run that cannot start leaves it
    as it was. A directory holding a run is refused unless `resume` (continue it, bit-identically) or
    `overwrite` (replace it); `weights_only` resumes from the weights alone where the checkpoint is not one
    unit. `max_steps` stops after that many optimizer steps in total (tests use it to interrupt a run).
    """
    run_dir = Path(run_dir)
    cfg.validate()  # a dataclass can be changed after it was made
    if weights_only and not resume:
        raise ConfigError("weights_only continues a run from its weights: use it with resume (--resume RUN_DIR)")
    if resume and overwrite:
        raise ConfigError("--resume continues a run and --overwrite replaces it: choose one")
    device = pick_device(cfg.device)
    info = D.setup(device)
    try:
        with ExitStack() as held:
            if info.is_main:
                check_target(run_dir, resume=resume, overwrite=overwrite)
                if resume:
                    held.enter_context(RunLock(run_dir))
            found = find_checkpoint(run_dir, weights_only=weights_only) if resume else None
            if cfg.threads:
                torch.set_num_threads(cfg.threads)
            if device.type == "cpu" and cfg.keep_freed_memory:
                allocator.keep_freed_memory()
            s = _setup(cfg, device, resume=resume)
            if cfg.batch_size % info.world_size:
                raise ConfigError(f"batch_size {cfg.batch_size} must divide evenly over {info.world_size} processes")
            gen = torch.Generator().manual_seed(cfg.seed)
            at = _restore(cfg, s, found, gen, run_dir, info)
            if info.is_main:
                take(run_dir, held, cfg.to_dict(), found, overwrite=overwrite)
                if found is not None:
                    print(f"resuming {run_dir} from {found.describe()}"
                          + (": the weights alone, optimizer and random state afresh" if found.state is None else ""),
                          flush=True)
            return _run(cfg, s, at, gen, run_dir, info, found, progress=progress, max_steps=max_steps)
    finally:
        D.teardown(info)


def _run(cfg: TrainConfig, s: Setup, at: Progress, gen: torch.Generator, run_dir: Path, info: D.DistInfo,
         found: Checkpoint | None, *, progress: bool, max_steps: int | None) -> TrainResult:
    model, ema, opt, device, task = s.model, s.ema, s.optimizer, s.device, s.task
    steps_per_epoch = task.train_size // cfg.batch_size
    total = steps_per_epoch * cfg.epochs
    warmup = max(1, int(cfg.warmup_epochs * steps_per_epoch))
    local = cfg.batch_size // info.world_size

    net = task.train_module  # the model itself for a classifier; for a captioner, its loss as one module
    if info.enabled:
        net = nn.parallel.DistributedDataParallel(net, device_ids=[device.index] if device.type == "cuda" else None)
    if cfg.compile:
        net = torch.compile(net, options=compile_options(device))

    meta = {"train_config": json.dumps(cfg.to_dict()), **task.metadata()}
    last = found if found is not None and found.state is not None else None  # the checkpoint in force
    last_save_t = time.monotonic()

    def save(tag: str = "last") -> None:
        nonlocal last, last_save_t
        if not info.is_main:
            return
        if tag == "best":
            save_model(model, run_dir / "best.safetensors", metadata={**meta, "step": str(at.step)})
            return
        if last is not None and last.step == at.step:
            return  # this step is saved already
        state = {"optimizer": opt.state_dict(), "generator": gen.get_state(), "torch_rng": torch.get_rng_state(),
                 **at.to_state()}
        last = save_checkpoint(run_dir, at.step, model=model, ema=ema, state=state, metadata=meta, previous=last)
        last_save_t = time.monotonic()

    def due() -> bool:
        """A checkpoint inside the epoch, every --checkpoint-every-steps steps or minutes."""
        n, minutes = cfg.checkpoint_every_steps, cfg.checkpoint_every_minutes
        return bool(n and at.step % n == 0) or bool(minutes and time.monotonic() - last_save_t >= 60 * minutes)

    def log(row: dict) -> None:
        if info.is_main:
            with open(run_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")

    def evaluate_and_log(epoch: float) -> dict:
        """Evaluate, write the metrics row (`epoch` is fractional inside an epoch: --eval-every-steps) and
        keep the best weights; the running epoch's training loss and accuracy are those so far."""
        nonlocal ev_step
        ev = task.evaluate(ema or model, device=device, bf16=s.bf16, info=info)
        # The evaluation is not a step: without this the bar's first rate after it counted its seconds as
        # one step's (the quick preset's time left read 6 hours for a while); its clock shows training time.
        bar.unpause()
        ev_step = at.step
        count = max(at.epoch_count, 1)
        row = {"epoch": epoch, "step": at.step, "lr": lr_at(at.step - 1, total, warmup, cfg),
               "train_loss": at.epoch_loss_sum / count, "train_acc": at.epoch_correct / count,
               "test_loss": ev["loss"], "test_acc": ev["acc"], "train_time_s": round(at.train_time_s, 2),
               "images_per_s": round(at.seen / max(at.train_time_s, 1e-9), 1) if at.seen else None,
               **task.row(ev)}
        log(row)
        if info.is_main:
            shown = f"epoch {epoch}/{cfg.epochs}" if isinstance(epoch, int) else f"epoch {epoch:.2f}, step {at.step}"
            bar.write(f"{shown}  train loss {row['train_loss']:.4f}  "
                      f"{cfg.eval_split} {task.metric_name} {100 * ev['acc']:.2f}%  "
                      f"({at.train_time_s / 60:.1f} min)")
        if ev["acc"] > at.best_acc:
            at.best_acc = ev["acc"]
            save("best")
        return ev

    stopped = "finished"
    end = total if max_steps is None else min(total, max_steps)
    bar = tqdm(total=total, initial=at.step, disable=not (progress and info.is_main), unit="step",
               dynamic_ncols=True,
               desc=f"train {cfg.model}" if task.kind == "classify" else f"train {cfg.captioner} captioner")
    ev, ev_step = None, -1  # the latest evaluation and the step it was made at
    with _Stopper() as stopper:
        while at.step < end:
            epoch, first = divmod(at.step, steps_per_epoch)
            order = epoch_order(task.train_size, cfg.seed, epoch)
            model.train()
            t0 = time.perf_counter()
            for i in range(first, steps_per_epoch):
                if at.step >= end:
                    break
                idx = order[i * cfg.batch_size : (i + 1) * cfg.batch_size]
                batch = task.batch(idx, gen)  # the whole global batch, augmented
                sl = slice(info.rank * local, (info.rank + 1) * local)
                for g in opt.param_groups:
                    g["lr"] = lr_at(at.step, total, warmup, cfg)
                loss, stats = task.loss(net, batch, sl, device, s.bf16)  # this rank's slice
                if not torch.isfinite(loss):
                    bar.close()
                    raise NonFiniteLoss(_non_finite(loss.item(), at.step, epoch, cfg, run_dir, last))
                opt.zero_grad(set_to_none=True)
                loss.backward()
                if cfg.clip_grad:
                    nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_grad)
                opt.step()
                if ema is not None:
                    _ema_update(ema, model, cfg.ema_decay)
                at.step += 1
                at.epoch_loss_sum += stats.loss_sum
                at.epoch_correct += stats.correct
                at.epoch_count += stats.count
                at.seen += stats.samples * info.world_size
                if i % 10 == 0 or i == steps_per_epoch - 1:
                    el = at.train_time_s + time.perf_counter() - t0
                    bar.set_postfix(epoch=epoch + 1, loss=f"{at.epoch_loss_sum / at.epoch_count:.3f}",
                                    acc=f"{at.epoch_correct / at.epoch_count:.3f}",
                                    img_s=f"{at.seen / max(el, 1e-9):.0f}", refresh=False)
                bar.update(1)
                if D.any_flag(stopper.flag, info):
                    stopped = "signal"
                    break
                inside = i < steps_per_epoch - 1 and at.step < end
                if inside and cfg.eval_every_steps and at.step % cfg.eval_every_steps == 0:
                    at.train_time_s += time.perf_counter() - t0
                    ev = evaluate_and_log(round(at.step / steps_per_epoch, 4))
                    model.train()
                    t0 = time.perf_counter()
                if inside and due():
                    at.train_time_s += time.perf_counter() - t0
                    t0 = time.perf_counter()
                    save("last")
            at.train_time_s += time.perf_counter() - t0
            if at.step % steps_per_epoch:  # stopped inside the epoch (a signal, max_steps)
                save("last")
                break
            ev = evaluate_and_log(epoch + 1)
            at.epoch_loss_sum, at.epoch_correct, at.epoch_count = 0.0, 0, 0
            save("last")
            if stopped == "signal":
                break
    bar.close()

    again = stopped == "finished" and task.final_differs()  # a stopped run leaves quickly
    final = ev if ev_step == at.step and not again else task.evaluate(
        ema or model, device=device, bf16=s.bf16, info=info, final=stopped == "finished")
    result = TrainResult(run_dir, final["acc"], max(at.best_acc, final["acc"]), at.train_time_s,
                         at.seen / max(at.train_time_s, 1e-9) if at.seen else 0.0, stopped)
    if info.is_main and stopped == "finished" and at.step >= total:
        task.report(run_dir, cfg, model, result, final)
    return result


def _non_finite(value: float, step: int, epoch: int, cfg: TrainConfig, run_dir: Path, last: Checkpoint | None) -> str:
    again = (f"a lower --lr (now {cfg.lr}), --clip-grad or --amp fp32; --resume would meet the same loss, so train "
             f"again: vitscope train --config {run_dir / 'config.json'} --lr LOWER")
    if last is None:
        return (f"loss became {value} at step {step} (epoch {epoch + 1}) before the run's first checkpoint, so "
                f"nothing was kept. Try {again} --out {run_dir} --overwrite")
    return (f"loss became {value} at step {step} (epoch {epoch + 1}); the run stopped, and {run_dir} keeps its last "
            f"good checkpoint, {last.describe()}. Try {again} --out NEW_DIR")
