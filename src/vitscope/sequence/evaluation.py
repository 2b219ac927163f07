"""The mode every evaluator runs a model in: eval (dropout off), then back to what it was."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn


@contextmanager
def evaluating(model: nn.Module) -> Iterator[nn.Module]:
    """`with evaluating(model):` the model in eval mode inside, in its earlier mode (training or not) after,
    also when the block raises."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)
