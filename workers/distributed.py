"""Process-group setup for one tensor-parallel group: rank 0 publishes an address and a free port,
every rank joins over tcp with an explicit timeout. NCCL on GPUs, gloo on CPUs, same code."""

import datetime
import socket

import torch
import torch.distributed as dist


def free_port(host: str = "") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def init_tp_group(
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    device: torch.device,
    timeout_s: float,
):
    """Join the group; returns the process group (None for TP=1, where nothing is communicated)."""
    if world_size == 1:
        return None
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend,
        init_method=f"tcp://{master_addr}:{master_port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
        device_id=device if device.type == "cuda" else None,
    )
    return dist.group.WORLD


def destroy_tp_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
