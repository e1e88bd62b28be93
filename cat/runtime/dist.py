"""Process-group setup (NCCL on CUDA, gloo on CPU) for torchrun or submitit, and small collective helpers."""

from __future__ import annotations

import os
import zlib
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["DistEnv", "init_distributed", "all_reduce_sum", "broadcast_object", "barrier"]


@dataclass(frozen=True)
class DistEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def _submitit_to_torchrun_env() -> None:
    """A submitit job with several tasks (one per GPU, started by Slurm or submitit's local executor,
    not torchrun): describe it the way torchrun would, rendezvous on the first node."""
    import submitit

    job = submitit.JobEnvironment()
    if job.num_tasks > 1:
        os.environ.setdefault("MASTER_ADDR", job.hostnames[0])
        os.environ.setdefault("MASTER_PORT", str(20000 + zlib.crc32(job.job_id.encode()) % 20000))
    os.environ.update(RANK=str(job.global_rank), WORLD_SIZE=str(job.num_tasks), LOCAL_RANK=str(job.local_rank))


def init_distributed(device: str = "auto", timeout_min: int = 30) -> DistEnv:
    """Join the process group torchrun (or a submitit job) describes in the environment, or run
    single-process. Uses NCCL when CUDA is available (one GPU per local rank), gloo otherwise.
    """
    if "WORLD_SIZE" not in os.environ and "SUBMITIT_EXECUTOR" in os.environ:
        _submitit_to_torchrun_env()
    use_cuda = torch.cuda.is_available() if device == "auto" else device == "cuda"
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if use_cuda:
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(
            backend="nccl" if use_cuda else "gloo",
            timeout=timedelta(minutes=timeout_min),
            **({"device_id": dev} if use_cuda else {}),
        )
    return DistEnv(rank=rank, world_size=world_size, local_rank=local_rank, device=dev)


def all_reduce_sum(t: Tensor) -> Tensor:
    """Sum ``t`` over all ranks (in place; a no-op single-process)."""
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def broadcast_object(obj: object, src: int = 0) -> object:
    """``obj`` from rank ``src`` on every rank."""
    if not (dist.is_available() and dist.is_initialized()):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
