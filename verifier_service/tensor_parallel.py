"""`specwire verifier --tensor-parallel-size N`: the verifier's process is rank 0 of N, and starts the other ranks
itself, one process each on this host (rank r on GPU r of --device cuda, all on the CPU with --device cpu).

Rank 0 owns everything but its share of the weights and the KV heads: the scheduler, the block manager, the
sampler, the streams. Before each forward, and before each copy inside the KV pool (copy-on-write blocks, a token
tree's accepted path), it broadcasts what to do; the other ranks do the same on their shares and take part in
the forward's all-reduces (common.tensor_parallel). They compute the same logits, and drop them.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import threading
import time
from typing import Any

import structlog
import torch

from common.paged_model import ForwardBatch, PagedCausalLM
from common.tensor_parallel import TensorParallel, backend_for

log = structlog.get_logger(__name__)

GROUP_TIMEOUT_S = 600  # a rank that does not join the group, or a collective that never completes, within this


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r's device: the r-th GPU after --device's (so cuda:0 + rank), or the CPU."""
    if device.type == "cpu":
        return device
    return torch.device(device.type, (device.index or 0) + rank)


def check_devices(device: torch.device, world_size: int) -> None:
    if device.type == "cuda" and (device.index or 0) + world_size > torch.cuda.device_count():
        raise ValueError(f"--tensor-parallel-size {world_size} from {device} needs {world_size} GPUs from there; "
                         f"torch sees {torch.cuda.device_count()}")


def init_rank(rank: int, world_size: int, init_method: str, device: torch.device) -> TensorParallel:
    import torch.distributed as dist

    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend_for(device), init_method=init_method, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    return TensorParallel(rank, world_size)


def min_over_ranks(value: int) -> int:
    """The smallest of every rank's `value` (the KV pool's block count: the same on every rank)."""
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.int64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


class _LeaderKVCache:
    """Rank 0's KV pool: a copy inside it is done on every rank's share."""

    def __init__(self, kv: Any, tp: TensorParallel) -> None:
        self._kv = kv
        self._tp = tp

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if copies:
            self._tp.broadcast(("copy_blocks", copies))
        self._kv.copy_blocks(copies)

    def copy_slots(self, moves: list[tuple[int, int]]) -> None:
        self._tp.broadcast(("copy_slots", moves))
        self._kv.copy_slots(moves)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._kv, name)


class LeaderModel:
    """Rank 0's model runner: the engine's forward and KV copies, done by every rank."""

    def __init__(self, model: PagedCausalLM, tp: TensorParallel, workers: list[multiprocessing.Process]) -> None:
        self.model = model
        self.tp = tp
        self.kv_cache = _LeaderKVCache(model.kv_cache, tp)
        self._workers = workers
        self._closed = False

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        self.tp.broadcast(("forward", batch))
        return self.model.forward(batch)

    def close(self) -> None:
        """Stop the other ranks (call it on the thread that ran the steps, once none runs)."""
        if self._closed:
            return
        self._closed = True
        try:
            self.tp.broadcast(("stop",))
        finally:
            for worker in self._workers:
                worker.join(10)
                if worker.is_alive():
                    worker.kill()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


def start_workers(config: Any, device: torch.device, init_method: str) -> list[multiprocessing.Process]:
    """Ranks 1..N-1, each in a process of its own (spawned: a fresh interpreter, no fork of a threaded one)."""
    context = multiprocessing.get_context("spawn")
    workers = []
    for rank in range(1, config.tensor_parallel_size):
        worker = context.Process(target=worker_main, args=(config, rank, init_method, os.getpid()),
                                 name=f"specwire-tp-rank{rank}", daemon=True)
        worker.start()
        workers.append(worker)
    return workers


def _exit_with_parent(parent_pid: int) -> None:
    """A rank whose rank 0 is gone (even SIGKILLed, with no goodbye) ends too, instead of waiting in a collective."""
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="tp-parent-watch", daemon=True).start()


def worker_main(config: Any, rank: int, init_method: str, parent_pid: int) -> None:
    """Rank `rank`: build its share of the model and the KV pool, then follow rank 0's steps until it stops."""
    from common.device import resolve_device, resolve_dtype_name
    from verifier_service.server import build_model_runner

    _exit_with_parent(parent_pid)
    threads = max(1, torch.get_num_threads() // config.tensor_parallel_size)
    torch.set_num_threads(threads)
    device = rank_device(resolve_device(config.device), rank)
    tp = init_rank(rank, config.tensor_parallel_size, init_method, device)
    dtype = resolve_dtype_name(config.dtype, device)
    _, model, _ = build_model_runner(config, device, dtype, tp)
    log.info("tensor_parallel_rank_ready", rank=rank, world_size=tp.world_size, device=str(device), threads=threads)
    follow(model, tp)


def follow(model: PagedCausalLM, tp: TensorParallel) -> None:
    import torch.distributed as dist

    while True:
        try:
            command = tp.broadcast()
        except RuntimeError as err:  # gloo/NCCL: rank 0 went without a goodbye (killed)
            log.error("tensor_parallel_rank0_gone", rank=tp.rank, error=str(err).splitlines()[0][:200])
            return
        op = command[0]
        if op == "forward":
            model.forward(command[1])
        elif op == "copy_blocks":
            model.kv_cache.copy_blocks(command[1])
        elif op == "copy_slots":
            model.kv_cache.copy_slots(command[1])
        elif op == "stop":
            break
        else:
            raise RuntimeError(f"unknown tensor-parallel command {op!r}")
    dist.destroy_process_group()
