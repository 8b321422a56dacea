"""`specwire verifier --tensor-parallel-size N`: the verifier's process is rank 0 of N, and starts the other ranks
itself, one process each on this host (rank r on GPU r of --device cuda, all on the CPU with --device cpu).

Rank 0 owns everything but its share of the weights and the KV heads: the scheduler, the block manager, the
sampler, the streams. Before each forward, and before each copy inside the KV pool (copy-on-write blocks, a token
tree's accepted path), it broadcasts what to do; the other ranks do the same on their shares and take part in
the forward's all-reduces (common.tensor_parallel). They compute the same logits, and drop them.
"""

from __future__ import annotations

import datetime
import logging
import multiprocessing
import os
import signal
import sys
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
    """Join the group. The rendezvous is a file (no listening socket), and the ranks talk over loopback unless
    GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME say otherwise: every rank is on this host."""
    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    extra = {}
    if device.type == "cuda":
        torch.cuda.set_device(device)
        extra["device_id"] = device  # NCCL's communicator on this rank's GPU, from the first collective on
    dist.init_process_group(backend_for(device), init_method=init_method, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S), **extra)
    return TensorParallel(rank, world_size)


def in_turn(tp: TensorParallel, work):
    """`work()` on one rank at a time, rank 0 first: loading and cutting the model holds a whole copy in host
    memory until it is cut, so the host needs one copy at a time, not one per rank."""
    import torch.distributed as dist

    result = None
    for turn in range(tp.world_size):
        if turn == tp.rank:
            result = work()
        dist.barrier()
    return result


def fatal(what: str) -> None:
    """The ranks can no longer be kept in step (a failed forward or copy on one of them, a rank gone): end the
    process, so that its drafts resume its sequences elsewhere and its supervisor restarts it."""
    log.critical("tensor_parallel_failed", what=what)
    logging.shutdown()
    os._exit(70)


def min_over_ranks(value: int) -> int:
    """The smallest of every rank's `value` (the KV pool's block count: the same on every rank)."""
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.int64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def _in_step(work, what: str):
    """Rank 0's part of a step: a failure leaves the other ranks waiting in a collective it never reaches."""
    try:
        return work()
    except Exception as err:  # noqa: BLE001 - any failure breaks the lockstep
        fatal(f"{what} failed on rank 0: {err!r}")


class _LeaderKVCache:
    """Rank 0's KV pool: a copy inside it is done on every rank's share."""

    def __init__(self, kv: Any, tp: TensorParallel) -> None:
        self._kv = kv
        self._tp = tp

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if copies:
            _in_step(lambda: self._tp.broadcast(("copy_blocks", copies)), "broadcast of a block copy")
        _in_step(lambda: self._kv.copy_blocks(copies), "a block copy")

    def copy_slots(self, moves: list[tuple[int, int]]) -> None:
        _in_step(lambda: self._tp.broadcast(("copy_slots", moves)), "broadcast of a slot copy")
        _in_step(lambda: self._kv.copy_slots(moves), "a slot copy")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._kv, name)


class LeaderModel:
    """Rank 0's model runner: the engine's forward and KV copies, done by every rank."""

    def __init__(self, model: PagedCausalLM, tp: TensorParallel, workers: list[multiprocessing.Process],
                 device: torch.device, stopping: threading.Event) -> None:
        self.model = model
        self.tp = tp
        self.kv_cache = _LeaderKVCache(model.kv_cache, tp)
        self._workers = workers
        self._device = device
        self._stopping = stopping

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        _in_step(lambda: self.tp.broadcast(("forward", batch)), "broadcast of a forward")
        return _in_step(lambda: self.model.forward(batch), "a forward")

    def close(self) -> None:
        """Stop the other ranks (once no step runs)."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        if self._device.type == "cuda":
            torch.cuda.set_device(self._device)  # the broadcast's device, on whatever thread calls this
        try:
            self.tp.broadcast(("stop",))
        finally:
            deadline = time.monotonic() + 10.0
            for worker in self._workers:
                worker.join(max(0.0, deadline - time.monotonic()))
                if worker.is_alive():
                    worker.kill()

    @property
    def closed(self) -> bool:
        return self._stopping.is_set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


def start_workers(config: Any, init_method: str, stopping: threading.Event) -> list[multiprocessing.Process]:
    """Ranks 1..N-1, each in a process of its own (spawned: a fresh interpreter, no fork of a threaded one). A
    rank that ends before `stopping` is set (it failed to load, or crashed) ends this process too."""
    context = multiprocessing.get_context("spawn")
    workers = []
    for rank in range(1, config.tensor_parallel_size):
        worker = context.Process(target=worker_main, args=(config, rank, init_method, os.getpid()),
                                 name=f"specwire-tp-rank{rank}", daemon=True)
        worker.start()
        workers.append(worker)

    def watch() -> None:
        while not stopping.is_set() and not sys.is_finalizing():
            for worker in workers:
                if not worker.is_alive() and not stopping.is_set() and not sys.is_finalizing():
                    fatal(f"tensor-parallel rank process {worker.name} ended (exit code {worker.exitcode})")
            time.sleep(0.5)

    threading.Thread(target=watch, name="tp-rank-watch", daemon=True).start()
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
    # a Ctrl-C or a SIGTERM to the whole process group is rank 0's to handle (it drains, then sends stop)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
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
        if op == "stop":
            break
        try:
            if op == "forward":
                model.forward(command[1])
            elif op == "copy_blocks":
                model.kv_cache.copy_blocks(command[1])
            elif op == "copy_slots":
                model.kv_cache.copy_slots(command[1])
            else:
                raise RuntimeError(f"unknown tensor-parallel command {op!r}")
        except Exception as err:  # noqa: BLE001 - rank 0 waits in a collective this rank will not reach
            fatal(f"{op} failed on rank {tp.rank}: {err!r}")
    dist.destroy_process_group()
