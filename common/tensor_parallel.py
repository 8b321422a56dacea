"""Tensor parallelism of the native forward (common.paged_model), Megatron-style, over torch.distributed.

Each of N ranks holds 1/N of every layer: the q, k and v projections and the MLP's gate and up projections split by
output columns (whole attention heads, whole KV heads, a slice of the intermediate size), the o and down
projections by input rows. A rank attends over its own heads only, so its KV pool holds its KV heads only (the
pool is sharded by heads), and the two row-split projections' partial outputs are summed over the ranks (one
all-reduce after attention and one after the MLP, per layer). Embeddings, norms and lm_head stay whole on every
rank: each computes the same logits.

Backends: gloo on CPU, nccl on CUDA; ROCm's torch answers to "nccl" with RCCL, so the same name serves AMD GPUs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from common.kv_cache import KVCacheSpec, LayerShape


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in the tensor-parallel group (the default process group)."""

    rank: int
    world_size: int

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks of a row-split projection's partial outputs, in place."""
        dist.all_reduce(x)
        return x

    def broadcast(self, obj: Any = None) -> Any:
        """Rank 0's `obj` on every rank (pickled: the step's batch, a KV copy, stop)."""
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]


def backend_for(device: torch.device) -> str:
    return "gloo" if device.type == "cpu" else "nccl"


def check_shardable(config: Any, world_size: int) -> None:
    """ValueError naming each size that the ranks cannot split evenly."""
    sizes = {"num_attention_heads": config.num_attention_heads,
             "num_key_value_heads": getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
             "intermediate_size": config.intermediate_size}
    uneven = [f"{name} {value}" for name, value in sizes.items() if value % world_size]
    if uneven:
        raise ValueError(f"--tensor-parallel-size {world_size} must divide the model's {', '.join(uneven)}")


def _split_columns(linear: torch.nn.Linear, tp: TensorParallel) -> None:
    """Keep this rank's slice of the outputs (rows of the weight)."""
    n = linear.weight.shape[0] // tp.world_size
    part = slice(tp.rank * n, (tp.rank + 1) * n)
    linear.weight = torch.nn.Parameter(linear.weight.data[part].clone(), requires_grad=False)
    if linear.bias is not None:
        linear.bias = torch.nn.Parameter(linear.bias.data[part].clone(), requires_grad=False)
    linear.out_features = n


def _split_rows(linear: torch.nn.Linear, tp: TensorParallel) -> None:
    """Keep this rank's slice of the inputs (columns of the weight); the bias is added once, by rank 0."""
    n = linear.weight.shape[1] // tp.world_size
    linear.weight = torch.nn.Parameter(linear.weight.data[:, tp.rank * n:(tp.rank + 1) * n].clone(),
                                       requires_grad=False)
    if linear.bias is not None and tp.rank:
        linear.bias = torch.nn.Parameter(torch.zeros_like(linear.bias.data), requires_grad=False)
    linear.in_features = n


def shard_model(model: Any, tp: TensorParallel) -> None:
    """Cut a Llama-family model (common.paged_model.NATIVE_MODEL_TYPES) to this rank's share, in place."""
    check_shardable(model.config, tp.world_size)
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for linear in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj):
            _split_columns(linear, tp)
        for linear in (attn.o_proj, mlp.down_proj):
            _split_rows(linear, tp)


def sharded_spec(spec: KVCacheSpec, world_size: int) -> KVCacheSpec:
    """One rank's KV pool: its share of every layer's KV heads."""
    if spec.layers is None:
        return dataclasses.replace(spec, num_kv_heads=spec.num_kv_heads // world_size)
    layers = [LayerShape(s.num_kv_heads // world_size, s.head_dim, s.v_head_dim) for s in spec.layers]
    return dataclasses.replace(spec, num_kv_heads=spec.num_kv_heads // world_size, layers=tuple(layers))
