"""Multi-process training through PyTorch's own DistributedDataParallel, as `torchrun` starts it.

`torchrun --nproc_per_node=N -m vitscope train ...` sets RANK / WORLD_SIZE / LOCAL_RANK; gloo on
CPU, nccl on GPU. Without those variables everything here is a no-op single process.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def setup(device: torch.device) -> DistInfo:
    """Join the process group torchrun describes in the environment (or stay single)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistInfo()
    info = DistInfo(int(os.environ["RANK"]), world, int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend=backend)
    return info


def teardown(info: DistInfo) -> None:
    """Leave the group together: rank 0 may still be drawing pictures while the others are done.

    Without the barrier a finished rank tore its gloo context down and exited while rank 0 was
    still busy, and now and then died of SIGABRT on the way out (seen once in CI).
    """
    if info.enabled and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def all_reduce_sum(t: torch.Tensor, info: DistInfo) -> torch.Tensor:
    if info.enabled:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def any_flag(flag: bool, info: DistInfo) -> bool:
    """True on every rank when any rank raised the flag (a signal arrives at one process)."""
    if not info.enabled:
        return flag
    t = torch.tensor([1 if flag else 0])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier()
