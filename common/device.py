"""Where a service runs: `--device auto|cpu|cuda|cuda:N`, what that device is, and how much of it the KV pool
may take. ROCm builds of torch report AMD GPUs as `cuda` devices too; `torch.version.hip` tells them apart."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.config import DEVICE_CHOICES_HELP  # defined there so the service configs (and the CLI) load no torch


@dataclass(frozen=True)
class DeviceInfo:
    device: str  # torch's name: cpu, cuda:0
    name: str  # the GPU's or CPU's name
    platform: str  # "CUDA 12.8", "HIP 6.3", or "CPU"
    total_memory: int  # bytes (0 on CPU: the host's memory is not ours to size)


def resolve_device(name: str) -> torch.device:
    """The torch device for a --device value; a GPU that is not there is a clear error."""
    name = name.strip().lower()
    if name == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if name == "cpu":
        return torch.device("cpu")
    if name == "cuda" or name.startswith("cuda:"):
        if not torch.cuda.is_available():
            build = f"ROCm {torch.version.hip}" if torch.version.hip else (
                f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU-only")
            raise ValueError(f"--device {name}: torch sees no GPU (this torch build: {build}); check the driver and "
                             "CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES, or use --device cpu")
        index = int(name.split(":", 1)[1]) if ":" in name else torch.cuda.current_device()
        if not 0 <= index < torch.cuda.device_count():
            raise ValueError(f"--device {name}: torch sees {torch.cuda.device_count()} GPU(s), indices 0.."
                             f"{torch.cuda.device_count() - 1}")
        return torch.device("cuda", index)
    raise ValueError(f"--device must be one of: {DEVICE_CHOICES_HELP}; got {name!r}")


def describe_device(device: torch.device) -> DeviceInfo:
    if device.type != "cuda":
        import platform

        return DeviceInfo(str(device), platform.processor() or platform.machine() or "cpu", "CPU", 0)
    props = torch.cuda.get_device_properties(device)
    gpu_platform = f"HIP {torch.version.hip}" if torch.version.hip else f"CUDA {torch.version.cuda}"
    return DeviceInfo(str(device), props.name, gpu_platform, props.total_memory)


def resolve_dtype_name(name: str, device: torch.device) -> str:
    """`auto`: bfloat16 on a GPU (half the bytes, tensor cores), float32 on CPU (oneDNN-packed fp32 is the
    fastest exact path there); any other name is kept."""
    if name != "auto":
        return name
    return "bfloat16" if device.type == "cuda" else "float32"


def kv_budget_from_utilization(device: torch.device, utilization: float, peak_bytes: int) -> int:
    """Bytes the KV pool may take on a GPU: `utilization` of the device's memory, minus what the process
    already holds at its measured peak (weights plus the activations of the largest step), minus what other
    processes hold. vLLM's `--gpu-memory-utilization` rule."""
    free, total = torch.cuda.mem_get_info(device)
    used_by_others = total - free - torch.cuda.memory_reserved(device)
    return int(total * utilization) - peak_bytes - max(0, used_by_others)
