"""The tasks the training loop trains, by `cfg.task`: each is one kind of training with its own data, model,
loss, evaluation, metric and report (the interface: training/task.py)."""

from __future__ import annotations

from vitscope.training.caption import CaptionTask
from vitscope.training.classify import ClassifyTask
from vitscope.training.config import TrainConfig
from vitscope.training.task import Task, check_unused
from vitscope.training.translate import TranslateTask

TASKS = {"classify": ClassifyTask, "caption": CaptionTask, "translate": TranslateTask}


def build_task(cfg: TrainConfig, *, resume: bool) -> Task:
    """The task `cfg.task` names, its data loaded and its model built (seeded by cfg.seed); a setting the task
    would ignore is refused first."""
    check_unused(cfg)
    return TASKS[cfg.task].build(cfg, resume=resume)
