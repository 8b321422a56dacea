"""A service's CPU threads: how many run its forward passes, and how the idle ones wait.

NOTE: libgomp reads OMP_NUM_THREADS and OMP_WAIT_POLICY once, when torch loads it, so `apply_cpu_threads` must run
before anything imports torch (the CLI calls it before it imports a service; common.config and the service configs
load no torch for that reason). torch.set_num_threads works at any time, and torch hands its count to every thread
that later runs a parallel op (the compute thread of common/compute_thread.py), but it cannot change how libgomp's
idle threads wait: when torch is already loaded (a service started in-process), only the thread count applies.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass

import structlog

log = structlog.get_logger(__name__)

DEFAULT_WAIT_POLICY = "passive"  # the other service on the host gets the cores an idle one does not use


@dataclass(frozen=True)
class CpuThreads:
    num_threads: int  # intra-op threads of the forward passes
    wait_policy: str  # "passive" or "active": OMP_WAIT_POLICY
    num_cores: int  # the cores this process may run on
    omp_env_applied: bool  # False: torch (and libgomp) loaded before the environment was set


def available_cores() -> int:
    """The cores this process may run on (its affinity mask: a pinned process, a container's cpuset)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _omp_num_threads(environ: Mapping[str, str]) -> int | None:
    """OMP_NUM_THREADS's first level ("4" or "4,2"), None when unset or unreadable."""
    first = environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    return int(first) if first.isdigit() and int(first) > 0 else None


def resolve_cpu_threads(num_threads: int, wait_policy: str | None, environ: Mapping[str, str],
                        num_cores: int) -> tuple[int, str]:
    """(threads, wait policy) for the flags' values: a flag given (threads > 0, a policy) wins; otherwise the OpenMP
    variable the environment already sets; otherwise every core and passive waiting."""
    threads = num_threads or _omp_num_threads(environ) or num_cores
    inherited = environ.get("OMP_WAIT_POLICY", "").strip().lower()
    policy = wait_policy or (inherited if inherited in ("passive", "active") else DEFAULT_WAIT_POLICY)
    return threads, policy


def apply_cpu_threads(config) -> CpuThreads:
    """Set OMP_NUM_THREADS and OMP_WAIT_POLICY in os.environ from `config` (a CpuThreadsConfig: --num-threads,
    --cpu-wait-policy). Call it before torch is imported, then `set_torch_threads` once it is."""
    num_cores = available_cores()
    threads, policy = resolve_cpu_threads(config.num_threads, config.cpu_wait_policy, os.environ, num_cores)
    applied = "torch" not in sys.modules
    os.environ["OMP_NUM_THREADS"] = str(threads)  # also read by child processes, and by MKL
    os.environ["OMP_WAIT_POLICY"] = policy.upper()
    return CpuThreads(threads, policy, num_cores, applied)


def set_torch_threads(threads: CpuThreads) -> None:
    """torch's intra-op thread count, after torch is imported; logs what this service runs with."""
    import torch

    torch.set_num_threads(threads.num_threads)
    log.info("cpu_threads", num_threads=torch.get_num_threads(), wait_policy=threads.wait_policy,
             num_cores=threads.num_cores, omp_env_applied=threads.omp_env_applied,
             **({} if threads.omp_env_applied else {
                 "note": "torch was imported before the OpenMP environment was set: only the thread count applies"}))
