"""A run's progress: where it is (`Progress`: its step, best metric, training time and the running epoch's
sums), what its checkpoint saves besides the weights, the optimizer and the generators.

Apart from checkpointing.py, which writes and checks the files a checkpoint is made of and carries this as one
dict among others: what the run counts, and how an older state's names read, is one thing to find here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Progress:
    """Where a run is: what a checkpoint saves besides the weights and the optimizer (the data position is
    the step: every epoch's order comes from (seed, epoch))."""

    step: int = 0
    best_metric: float = 0.0  # the best value of the task's Metric (accuracy, CIDEr-D, exact match) so far
    train_time_s: float = 0.0
    seen: int = 0
    # the running epoch's training loss and accuracy so far, so a resumed epoch reports the same numbers
    epoch_loss_sum: float = 0.0
    epoch_correct: int = 0
    epoch_count: int = 0
    train_cpu_s: float = 0.0  # the process's CPU seconds of training, all its threads

    def to_state(self) -> dict:
        return {"step": self.step, "best_metric": self.best_metric, "train_time_s": self.train_time_s,
                "seen": self.seen,
                "epoch_sums": [self.epoch_loss_sum, self.epoch_correct, self.epoch_count],
                "train_cpu_s": self.train_cpu_s}

    @classmethod
    def from_state(cls, s: dict) -> Progress:
        sums = s.get("epoch_sums")
        if not (isinstance(sums, (list, tuple)) and len(sums) == 3 and all(isinstance(x, (int, float)) for x in sums)):
            sums = [0.0, 0, 0]  # runs saved before these were kept start the epoch's sums at 0
        cpu = s.get("train_cpu_s")  # runs saved before it was kept count from 0
        return cls(int(s["step"]), float(s[best_metric_key(s)]), float(s["train_time_s"]), int(s["seen"]),
                   float(sums[0]), int(sums[1]), int(sums[2]), float(cpu) if isinstance(cpu, (int, float)) else 0.0)


def best_metric_key(state: dict) -> str:
    """Where a state holds the best metric: states saved before it was named for every task's metric call it
    best_acc (an accuracy, a CIDEr-D or an exact match all the same)."""
    return "best_acc" if "best_metric" not in state and "best_acc" in state else "best_metric"
