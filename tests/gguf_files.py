"""GGUF files for the tests, written with gguf-py from tiny models: no downloads."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter, quants

from common.model_loading import record_source


def q4_k_blocks(rows: int, columns: int, seed: int) -> np.ndarray:
    """Random but well-formed Q4_K rows: every scale, min and code pattern the 12-byte packing can hold."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows, columns // 256, 144), dtype=np.uint8)
    d = (rng.random((rows, columns // 256)) * 0.01 + 1e-4).astype(np.float16)
    dmin = (rng.random((rows, columns // 256)) * 0.01).astype(np.float16)
    blocks[..., 0:2] = d[..., None].view(np.uint8).reshape(rows, -1, 2)
    blocks[..., 2:4] = dmin[..., None].view(np.uint8).reshape(rows, -1, 2)
    return blocks.reshape(rows, -1)


def quantized(type_name: str, weight: np.ndarray, seed: int = 0) -> np.ndarray:
    if type_name == "Q4_K":  # gguf-py cannot quantize to Q4_K: random blocks stand in for llama-quantize's
        return q4_k_blocks(*weight.shape, seed)
    return quants.quantize(weight.astype(np.float32), GGMLQuantizationType[type_name])


def llama_interleave(rows: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's converter does to a Llama q/k projection (and transformers undoes on load)."""
    n = rows.shape[0]
    return rows.reshape(heads, 2, n // heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def write_gguf(path: Path, model, types: dict[str, str], *, llama_rows: bool = False, default: str = "Q4_0") -> None:
    """A GGUF holding `model`'s linears in the given types (`default` unless named), then the model's weights replaced by the
    file's float values, as a conversion of that file would load them."""
    writer = GGUFWriter(str(path), model.config.model_type)
    heads = {"attn_q": model.config.num_attention_heads, "attn_k": model.config.num_key_value_heads}
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}
    modules = {"output.weight": model.lm_head}
    for i, layer in enumerate(model.model.layers):
        for hf, gg in names.items():
            modules[f"blk.{i}.{gg}.weight"] = layer.get_submodule(hf)
    with torch.no_grad():
        for name, linear in modules.items():
            type_name = types.get(name, default)
            raw = quantized(type_name, linear.weight.to(torch.float32).numpy(), seed=len(name))
            values = quants.dequantize(raw, GGMLQuantizationType[type_name])
            kind = name.split(".")[-2]
            if llama_rows and kind in heads:  # the file holds interleaved rows; the model the original order
                raw = llama_interleave(raw, heads[kind])
            writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=GGMLQuantizationType[type_name])
            linear.weight.copy_(torch.from_numpy(values))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def gguf_source(model_dir: Path, type_name: str = "Q4_0") -> Path:
    """Turn a saved tiny model into the conversion of a GGUF: write MODEL_DIR.gguf with its linears in
    `type_name`, put the file's float values back into the directory, and record the file as its source."""
    from transformers import AutoModelForCausalLM

    model_dir = Path(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    path = model_dir.with_suffix(".gguf")
    write_gguf(path, model, {}, default=type_name)
    model.save_pretrained(model_dir)
    record_source(model_dir, path)
    return path
