"""The run's probes file: the attention of a few fixed inputs at every evaluation, kept beside metrics.jsonl
(what it holds and how to look at it: vitscope.inspect.probes).

Each record adds one step's tensors (float16, a few kB to a few hundred) and rewrites the file whole under a
temporary name, so a crash leaves the previous file. A resumed run first cuts the file back to its checkpoint's
step, as it cuts metrics.jsonl; the steps after it are recorded again from the same weights, so the file ends as
a run that never stopped would have left it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import Tensor

from vitscope.inspect.probes import FILE, FORMAT, probes_figure, read_probes
from vitscope.io import atomic_write

PROBES = 4  # the inputs a run probes, at most


class ProbeLog:
    """Writes `run_dir/probes.safetensors`. `header` is what the task says of its probed inputs (kind, inputs,
    and for images their grid and prefix tokens); `images` (K, C, H, W) uint8 where the inputs are images."""

    def __init__(self, run_dir: Path, header: dict, images: Tensor | None = None):
        self.path = Path(run_dir) / FILE
        self.header = {"format": FORMAT, **header, "epochs": {}}
        self.tensors: dict[str, Tensor] = {}
        self.unwritten = False
        if images is not None:
            self.tensors["inputs/images"] = images.contiguous()

    def load(self, step: int) -> None:
        """Take up a resumed run's file, the steps after `step` left out (a run killed after its checkpoint
        recorded them; they are recorded again)."""
        if not self.path.is_file():
            return
        kept = read_probes(self.path)
        for s in kept.steps:
            if s <= step:
                for name, t in kept.tensors[s].items():
                    self.tensors[f"step{s}/{name}"] = t
                self.header["epochs"][str(s)] = kept.epochs[kept.steps.index(s)]
        self._write()

    def has(self, step: int) -> bool:
        return str(step) in self.header["epochs"]

    def record(self, step: int, epoch: float, tensors: dict[str, Tensor], *, write: bool = True) -> None:
        """Add one step's tensors; `write=False` keeps them until the next write (step 0's, so that a run which
        fails before its first evaluation or checkpoint leaves nothing behind)."""
        for name, t in tensors.items():
            self.tensors[f"step{step}/{name}"] = t.detach().to("cpu", torch.float16).contiguous()
        self.header["epochs"][str(step)] = epoch
        self.unwritten = not write
        if write:
            self._write()

    def flush(self) -> None:
        """Write what `record(..., write=False)` kept back (a checkpoint is being saved)."""
        if self.unwritten:
            self._write()

    def _write(self) -> None:
        self.unwritten = False
        meta = {"probes": json.dumps(self.header)}
        atomic_write(self.path, lambda tmp: save_file(self.tensors, str(tmp), metadata=meta))


def write_probe_report(run_dir: Path) -> list[Path]:
    """probes.png: the attention at four steps, side by side. (The slider over every step is the explorer's
    "Over training" section: the task's report reads the probes into explorer.html, captions.html or
    translations.html.)"""
    probes_figure(read_probes(run_dir), path=run_dir / "probes.png")
    return [run_dir / "probes.png"]
