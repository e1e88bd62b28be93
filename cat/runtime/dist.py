"""Process-group setup (NCCL on CUDA, gloo on CPU) for torchrun or submitit, and small collective helpers."""

from __future__ import annotations

import os
import socket
import zlib
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

from cat.errors import UserError

__all__ = [
    "DistEnv",
    "init_distributed",
    "rendezvous_port",
    "describe_hosts",
    "hosts_by_rank",
    "all_reduce_sum",
    "broadcast_object",
    "barrier",
]

T = TypeVar("T")


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


def _submitit_to_torchrun_env() -> bool:
    """A submitit job with several tasks (one per GPU, started by Slurm or submitit's local executor,
    not torchrun): describe it the way torchrun would, rendezvous on the first node. Whether it has
    several tasks (then no torchrun agent holds the rendezvous: :func:`_rendezvous` opens it)."""
    import submitit

    job = submitit.JobEnvironment()
    if job.num_tasks > 1:
        os.environ.setdefault("MASTER_ADDR", job.hostnames[0])
        os.environ.setdefault("MASTER_PORT", str(rendezvous_port(job.job_id)))
    os.environ.update(RANK=str(job.global_rank), WORLD_SIZE=str(job.num_tasks), LOCAL_RANK=str(job.local_rank))
    return job.num_tasks > 1


def rendezvous_port(job_id: str) -> int:
    """A job's own rendezvous port, 20000-31999, as the sbatch templates derive it (common.sh): two
    jobs sharing a node never bind the same one, and no outgoing connection holds it (Linux gives
    those ports from 32768 up). Slurm's numeric job id (unique per array task) when there is one,
    else a checksum of submitit's id (its local executor)."""
    slurm_id = os.environ.get("SLURM_JOB_ID", "")
    number = int(slurm_id) if slurm_id.isdigit() else zlib.crc32(job_id.encode())
    return 20000 + number % 12000


def _rendezvous(rank: int, world_size: int, timeout: timedelta) -> dist.TCPStore:
    """The store the ranks of a submitit job meet at, rank 0's at ``MASTER_ADDR:MASTER_PORT``: each rank
    waits for the others at most ``timeout``, and a rank that cannot meet them says why in one line (rank
    0 whose port is taken would otherwise leave the others waiting on a rendezvous that never opens)."""
    address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    try:
        return dist.TCPStore(address, port, world_size, rank == 0, timeout=timeout, wait_for_workers=True)
    except dist.DistError as error:
        reason = str(error).splitlines()[0]
        if rank == 0:
            raise UserError(
                f"rank 0 could not open the job's rendezvous on port {port} ({reason}); "
                "give the job a free port with MASTER_PORT=... (CAT_RDZV_PORT=... for the sbatch templates)"
            ) from None
        raise UserError(
            f"rank {rank} of {world_size} could not reach the job's rendezvous at {address}:{port} within "
            f"{timeout.total_seconds():.0f} s (dist_timeout_s): rank 0 did not open it (its log says why) or the "
            f"port is blocked between the nodes ({reason})"
        ) from None


def init_distributed(device: str = "auto", timeout_s: int = 1800) -> DistEnv:
    """Join the process group torchrun (or a submitit job) describes in the environment, or run
    single-process. Uses NCCL when CUDA is available (one GPU per local rank), gloo otherwise.
    A collective that waits ``timeout_s`` for another rank (one lost with its node) raises.
    """
    own_rendezvous = (
        "WORLD_SIZE" not in os.environ and "SUBMITIT_EXECUTOR" in os.environ and _submitit_to_torchrun_env()
    )
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
        timeout = timedelta(seconds=timeout_s)
        dist.init_process_group(
            backend="nccl" if use_cuda else "gloo",
            store=_rendezvous(rank, world_size, timeout) if own_rendezvous else None,
            rank=rank,
            world_size=world_size,
            timeout=timeout,
            device_id=dev if use_cuda else None,
        )
    return DistEnv(rank=rank, world_size=world_size, local_rank=local_rank, device=dev)


def describe_hosts(env: DistEnv) -> str:
    """Where the ranks run, e.g. ``cat-n1 (ranks 0-7), cat-n2 (ranks 8-15)`` (one all-gather)."""
    hosts: list[str] = [socket.gethostname()] * env.world_size
    if env.distributed:
        dist.all_gather_object(hosts, hosts[0])
    return hosts_by_rank(hosts)


def hosts_by_rank(hosts: list[str]) -> str:
    """``hosts[r]`` is rank r's host: each host once, with its ranks (a span when they are consecutive)."""
    ranks: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        ranks.setdefault(host, []).append(rank)

    def span(r: list[int]) -> str:
        if len(r) == 1:
            return f"rank {r[0]}"
        return f"ranks {r[0]}-{r[-1]}" if r == list(range(r[0], r[-1] + 1)) else "ranks " + ",".join(map(str, r))

    return ", ".join(f"{host} ({span(r)})" for host, r in ranks.items())


def all_reduce_sum(t: Tensor) -> Tensor:
    """Sum ``t`` over all ranks (in place; a no-op single-process)."""
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def broadcast_object(obj: T, src: int = 0) -> T:
    """``obj`` from rank ``src`` on every rank."""
    if not (dist.is_available() and dist.is_initialized()):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
