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


COLUMN_SPLIT = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
ROW_SPLIT = ("self_attn.o_proj", "mlp.down_proj")  # their outputs are summed over the ranks


def check_layers(model: Any) -> None:
    """ValueError unless every decoder layer has the Llama family's separate projections as plain nn.Linear and
    nothing per head beside them that a cut would split wrong: the modules that shard_model cuts. Fused
    projections (phi3's qkv_proj), mixture-of-experts MLPs, attention sinks and q/k norms over the whole
    projection (olmo2) are refused, naming the first layer's problem."""
    layer = model.model.layers[0]
    problems = []
    for name in (*COLUMN_SPLIT, *ROW_SPLIT):
        module = layer.get_submodule(name) if _has(layer, name) else None
        if type(module) is not torch.nn.Linear:
            problems.append(f"no nn.Linear {name}")
    attn = getattr(layer, "self_attn", None)
    if attn is not None and getattr(attn, "sinks", None) is not None:
        problems.append("attention sinks (one per head)")
    head_dim = getattr(attn, "head_dim", None)
    for norm in ("q_norm", "k_norm"):
        weight = getattr(getattr(attn, norm, None), "weight", None)
        if weight is not None and head_dim is not None and weight.numel() != head_dim:
            problems.append(f"{norm} over the whole projection")
    if problems:
        raise ValueError(f"{model.config.model_type!r} cannot be split by tensor parallelism here: "
                         f"{', '.join(problems)} (specwire shards Llama-style layers: separate q, k, v, o and "
                         "gate, up, down projections)")


def _has(module: torch.nn.Module, name: str) -> bool:
    try:
        module.get_submodule(name)
    except AttributeError:
        return False
    return True


def shard_model(model: Any, tp: TensorParallel) -> None:
    """Cut a model with Llama-style layers (check_layers) to this rank's share, in place."""
    check_shardable(model.config, tp.world_size)
    check_layers(model)
    for layer in model.model.layers:
        for name in COLUMN_SPLIT:
            _split_columns(layer.get_submodule(name), tp)
        for name in ROW_SPLIT:
            _split_rows(layer.get_submodule(name), tp)


def sum_row_split_outputs(model: Any, tp: TensorParallel) -> None:
    """For a model whose own modules compute each layer (the transformers backend): sum each row-split
    projection's output over the ranks, by a forward hook on whatever module holds that place now (a packed
    drop-in included)."""
    def summed(module: torch.nn.Module, inputs: Any, output: torch.Tensor) -> torch.Tensor:
        return tp.all_reduce(output)

    for layer in model.model.layers:
        for name in ROW_SPLIT:
            layer.get_submodule(name).register_forward_hook(summed)


def sharded_spec(spec: KVCacheSpec, world_size: int) -> KVCacheSpec:
    """One rank's KV pool: its share of every layer's KV heads."""
    if spec.layers is None:
        return dataclasses.replace(spec, num_kv_heads=spec.num_kv_heads // world_size)
    layers = [LayerShape(s.num_kv_heads // world_size, s.head_dim, s.v_head_dim) for s in spec.layers]
    return dataclasses.replace(spec, num_kv_heads=spec.num_kv_heads // world_size, layers=tuple(layers))
