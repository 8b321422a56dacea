"""A GGUF file's quantized blocks, mapped onto the int4 layout of common.cpu_linear instead of requantized.

The services load a GGUF through its float conversion (common.model_loading). With --quantization int4, each linear
whose GGUF tensor is Q4_0, Q4_1 or Q4_K takes its 4-bit codes straight from the file: those formats are affine
per 32 weights, exactly torch's int4 convention w = (q - 8) * scale + zero with group 32.

    Q4_0  w = d * (q - 8)             scale = d         zero = 0
    Q4_1  w = d * q + m               scale = d         zero = 8 d + m
    Q4_K  w = d sc_j q - dmin m_j     scale = d sc_j    zero = 8 d sc_j - dmin m_j   (sub-block j of 32)

The codes map bit for bit and scale and zero exactly in float32; the CPU kernel then holds scale and zero in
bfloat16 (its activations' dtype), which rounds them to 8 significant bits. Every other type is requantized from
its float values: Q8_0 and Q5_0 are symmetric per 32 weights with 8 and 5 bits, which neither per-channel int8
nor 4-bit codes can hold; Q6_K and Q5_K have 6 and 5 bits; Q2_K and Q3_K use sub-blocks of 16.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import structlog
import torch

from common.cpu_linear import INT4_GROUP, Int4Weights

log = structlog.get_logger(__name__)

INT4_EXACT_TYPES = ("Q4_0", "Q4_1", "Q4_K")

# HF module (inside model.layers.N) -> GGUF tensor (inside blk.N), for the Llama family.
_LAYER_TENSORS = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
# NOTE: a relative error this small can only come from rounding (bf16 weights, float32 arithmetic order); a
# wrong tensor, layout or row order is off by the order of the weights themselves.
_MATCH_TOLERANCE = 1e-2


def _f16(raw: np.ndarray, offset: int) -> torch.Tensor:  # [rows, blocks] float32 from a little-endian f16 field
    return torch.from_numpy(np.ascontiguousarray(raw[..., offset:offset + 2]).view(np.float16)[..., 0]
                            .astype(np.float32))


def _nibbles_32(qs: np.ndarray) -> np.ndarray:  # [..., 16] bytes -> [..., 32] codes: low nibbles, then high
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _decode_q4_0(raw: np.ndarray) -> tuple[np.ndarray, torch.Tensor, torch.Tensor]:
    d = _f16(raw, 0)
    return _nibbles_32(raw[..., 2:18]), d, torch.zeros_like(d)


def _decode_q4_1(raw: np.ndarray) -> tuple[np.ndarray, torch.Tensor, torch.Tensor]:
    d, m = _f16(raw, 0), _f16(raw, 2)
    return _nibbles_32(raw[..., 4:20]), d, 8.0 * d + m


def _decode_q4_k(raw: np.ndarray) -> tuple[np.ndarray, torch.Tensor, torch.Tensor]:
    d, dmin = _f16(raw, 0)[..., None], _f16(raw, 2)[..., None]  # [rows, blocks, 1]
    s = raw[..., 4:16].astype(np.int32)  # 8 six-bit scales and 8 six-bit mins, packed in 12 bytes
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 6) << 4)], axis=-1)
    mins = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], axis=-1)
    # 128 bytes in 4 runs of 32: sub-block 2c is run c's low nibbles, sub-block 2c + 1 its high nibbles
    qs = raw[..., 16:144].reshape(*raw.shape[:-1], 4, 32)
    q = np.stack([qs & 0x0F, qs >> 4], axis=-2).reshape(*raw.shape[:-1], 8, 32)
    scale = d * torch.from_numpy(sc.astype(np.float32))  # exact: an 11-bit f16 times a 6-bit integer
    zero = 8.0 * scale - dmin * torch.from_numpy(mins.astype(np.float32))
    return q, scale, zero


_DECODERS: dict[str, tuple[int, int, Callable[[np.ndarray], tuple[np.ndarray, torch.Tensor, torch.Tensor]]]] = {
    # type: (weights per block, bytes per block, decoder of [rows, blocks, bytes])
    "Q4_0": (32, 18, _decode_q4_0),
    "Q4_1": (32, 20, _decode_q4_1),
    "Q4_K": (256, 144, _decode_q4_k),
}


def decode_int4(type_name: str, raw: np.ndarray, columns: int) -> Int4Weights:
    """A Q4_0/Q4_1/Q4_K tensor's bytes ([rows, bytes per row] uint8) as int4 codes, scales and zeros."""
    if type_name not in _DECODERS:
        raise ValueError(f"GGUF type {type_name} does not map onto int4 (only {', '.join(INT4_EXACT_TYPES)} do)")
    per_block, block_bytes, decoder = _DECODERS[type_name]
    rows = raw.shape[0]
    if columns % per_block or raw.shape[1] != columns // per_block * block_bytes:
        raise ValueError(f"{type_name}: {raw.shape[1]} bytes per row do not hold {columns} weights")
    q, scale, zero = decoder(raw.reshape(rows, columns // per_block, block_bytes))
    return Int4Weights(torch.from_numpy(np.ascontiguousarray(q).reshape(rows, columns).astype(np.int32)),
                       scale.reshape(rows, columns // INT4_GROUP).contiguous(),
                       zero.reshape(rows, columns // INT4_GROUP).contiguous())


@dataclass
class GGUFTensor:
    type_name: str
    raw: np.ndarray  # [rows, bytes per row] uint8 (a view of the memory-mapped file)
    columns: int


class GGUFFile:
    """The tensors of one GGUF file, memory-mapped."""

    def __init__(self, path: str | Path) -> None:
        from gguf import GGUFReader

        self.path = Path(path)
        reader = GGUFReader(self.path)
        self.tensors: dict[str, GGUFTensor] = {}
        for t in reader.tensors:
            columns = int(t.shape[0])  # GGUF lists dimensions innermost first
            raw = np.asarray(t.data).view(np.uint8)
            self.tensors[t.name] = GGUFTensor(t.tensor_type.name, raw.reshape(raw.shape[0], -1) if raw.ndim > 1
                                              else raw.reshape(1, -1), columns)


@dataclass
class Int4Mapping:
    """Codes for the linears a GGUF maps exactly, keyed by HF module name, and what happened to the others."""

    codes: dict[str, Int4Weights] = field(default_factory=dict)
    requantized: dict[str, str] = field(default_factory=dict)  # HF module -> why (its GGUF type, or a mismatch)

    def summary(self) -> dict[str, Any]:
        return {"exact": len(self.codes), "requantized": len(self.requantized),
                "requantized_types": sorted(set(self.requantized.values()))}


def _llama_rows(rows: int, heads: int) -> torch.Tensor:
    """llama.cpp stores a Llama q/k projection with its rows interleaved per head; transformers undoes it. This
    is the GGUF row each HF row comes from."""
    return torch.arange(rows).reshape(heads, rows // heads // 2, 2).transpose(1, 2).reshape(-1)


def _take_rows(w: Int4Weights, rows: torch.Tensor) -> Int4Weights:
    return Int4Weights(w.q[rows], w.scale[rows], w.zero[rows])


def _matches(decoded: torch.Tensor, weight: torch.Tensor) -> bool:
    weight = weight.detach().to(torch.float32)
    return bool(torch.linalg.vector_norm(decoded - weight) <= _MATCH_TOLERANCE * torch.linalg.vector_norm(weight))


def map_int4(model: Any, gguf: GGUFFile) -> Int4Mapping:
    """Int4 codes from `gguf` for each linear of `model` (a transformers Llama-family model loaded from that
    file's conversion) whose tensor is Q4_0/Q4_1/Q4_K. Each mapped matrix is checked against the model's own
    weight, so a file that is not this model's source, or a row order this code does not know, falls back to
    requantization instead of producing a different model."""
    config = model.config
    heads = {"attn_q": config.num_attention_heads,
             "attn_k": getattr(config, "num_key_value_heads", None) or config.num_attention_heads}
    modules: dict[str, tuple[torch.nn.Linear, str]] = {}
    for i, layer in enumerate(model.model.layers):
        for hf_name, gguf_name in _LAYER_TENSORS.items():
            modules[f"model.layers.{i}.{hf_name}"] = (layer.get_submodule(hf_name), f"blk.{i}.{gguf_name}.weight")
    head_source = "output.weight" if "output.weight" in gguf.tensors else "token_embd.weight"
    modules["lm_head"] = (model.lm_head, head_source)
    mapping = Int4Mapping()
    for hf_name, (linear, tensor_name) in modules.items():
        tensor = gguf.tensors.get(tensor_name)
        if tensor is None:
            mapping.requantized[hf_name] = "missing"
            continue
        if tensor.type_name not in INT4_EXACT_TYPES:
            mapping.requantized[hf_name] = tensor.type_name
            continue
        codes = decode_int4(tensor.type_name, tensor.raw, tensor.columns)
        candidates = [codes]
        kind = tensor_name.split(".")[-2]
        if kind in heads and codes.q.shape[0] % (2 * heads[kind]) == 0:
            candidates.append(_take_rows(codes, _llama_rows(codes.q.shape[0], heads[kind])))
        found = next((c for c in candidates if tuple(c.q.shape) == tuple(linear.weight.shape)
                      and _matches(c.dequantized(), linear.weight)), None)
        if found is None:
            mapping.requantized[hf_name] = "mismatch"
            log.warning("gguf_tensor_mismatch", module=hf_name, tensor=tensor_name, type=tensor.type_name,
                        gguf=str(gguf.path))
            continue
        mapping.codes[hf_name] = found
    return mapping
