"""A Llama-family forward pass (Llama, Qwen2, Mistral, Qwen3) over a flattened batch of variable-length query chunks
against the paged KV cache.

The weights, norms, MLPs and rotary embedding are the transformers model's own modules, so RoPE scaling, biases
and activations follow the config exactly; only attention and the cache are ours. Qwen3 differs from the others
only by an RMSNorm over each head of q and of k, before RoPE. Prefill chunks, verification
blocks and draft steps of many sequences run in one pass: the projections and MLPs see all tokens at once, and
attention runs per sequence through kernels.paged_attention.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import torch

from common.config import QUANTIZATIONS
from common.cpu_linear import Int4Linear, Int8Linear, PackedLinear, onednn_packs
from common.gguf_weights import GGUFFile, map_int4
from common.kv_cache import KVCache, KVCacheSpec
from common.tensor_parallel import TensorParallel
from kernels import platform
from kernels.kv_cache_write import write_kv
from kernels.paged_attention import (
    AttentionMetadata,
    TreeMask,
    attention_metadata,
    longest_query,
    paged_attention,
    paged_attention_tensors,
)

log = structlog.get_logger(__name__)

NATIVE_MODEL_TYPES = ("llama", "qwen2", "mistral", "qwen3")  # what PagedCausalLM computes (--model-impl native)


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    slot_mapping: torch.Tensor  # [num_tokens] int64, where each token's K/V is written
    query_start: list[int]  # [num_seqs + 1]
    context_lens: list[int]  # [num_seqs], tokens in the cache once this batch is written
    block_tables: list[list[int]]  # [num_seqs] block ids
    logits_indices: torch.Tensor | None  # [num_logits] int64 rows whose logits are returned; None: every row
    # the Triton path's attention metadata already on the device (common.static_forward); None: built from the
    # lists above when the Triton path runs
    attention: AttentionMetadata | None = None
    tree: TreeMask | None = None  # token trees among the queries (kernels.paged_attention); None: none

    def attention_metadata(self, device: torch.device) -> AttentionMetadata:
        """The Triton path's metadata: the one held, or built from the lists in one host-to-device copy."""
        if self.attention is not None:
            return self.attention
        return attention_metadata(self.block_tables, self.query_start, self.context_lens, device, self.tree)

    @property
    def max_query_len(self) -> int:
        return longest_query(self.query_start)

    def to(self, device: torch.device) -> ForwardBatch:
        """The tensors on `device`, in one host-to-device copy."""
        if self.input_ids.device == device:
            return self
        parts = [self.input_ids, self.positions, self.slot_mapping]
        if self.logits_indices is not None:
            parts.append(self.logits_indices)
        moved = torch.cat(parts).to(device).split([t.numel() for t in parts])
        # the tree's masks stay on the host: the reference reads them there, attention_metadata() copies them
        return ForwardBatch(moved[0], moved[1], moved[2], self.query_start, self.context_lens, self.block_tables,
                            moved[3] if self.logits_indices is not None else None, self.attention, self.tree)


def kv_cache_spec(model: Any) -> KVCacheSpec:
    config = model.config
    num_heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    return KVCacheSpec(
        num_layers=config.num_hidden_layers,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
        head_dim=head_dim,
        dtype=model.dtype,
    )


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class PagedCausalLM:
    model_impl = "native"

    def __init__(self, model: Any, kv_cache: KVCache, *, pack_weights: bool = True,
                 release_unpacked: bool = False, quantization: str = "none",
                 gguf_path: str | Path | None = None, tp: TensorParallel | None = None) -> None:
        """quantization "int8" or "int4": every linear layer (lm_head included) weight-only quantized, on CPU
        (common.cpu_linear.Int8Linear / Int4Linear); "none": the model's own weights (oneDNN-packed on CPU).
        gguf_path: the GGUF file the model was converted from; with int4, its Q4 blocks are used as they are
        (common.gguf_weights) instead of requantizing their float values. tp: this rank's place in a
        tensor-parallel group; the model was cut to its share (common.tensor_parallel.shard_model) and kv_cache
        holds its share of the KV heads."""
        self.model = model
        self.kv_cache = kv_cache
        self.tp = tp
        spec = kv_cache.spec
        config = model.config
        self.num_heads = config.num_attention_heads // (tp.world_size if tp is not None else 1)
        self.num_kv_heads = spec.num_kv_heads
        self.head_dim = spec.head_dim
        self.layers = model.model.layers
        self.embed_tokens = model.model.embed_tokens
        self.norm = model.model.norm
        self.rotary_emb = model.model.rotary_emb
        self.lm_head = model.lm_head
        # a config without layer_types (Mistral) windows every layer with its sliding_window, as transformers does
        window = getattr(config, "sliding_window", None)
        default_type = "sliding_attention" if window and getattr(config, "use_sliding_window", True) else "full_attention"
        layer_types = getattr(config, "layer_types", None) or [default_type] * len(self.layers)
        self.sliding_windows = [window if t == "sliding_attention" and window else None for t in layer_types]
        self.scale = getattr(self.layers[0].self_attn, "scaling", self.head_dim**-0.5)
        # Qwen3: per-head RMSNorm of q and k before RoPE
        self.qk_norm = [(la.self_attn.q_norm, la.self_attn.k_norm) if hasattr(la.self_attn, "q_norm") else None
                        for la in self.layers]
        # NOTE: bfloat16 is packed too: memory-bound decoding reads half the bytes (a 0.5B draft step halves).
        if quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}")
        if quantization != "none" and (model.device.type != "cpu" or model.dtype not in (torch.float32,
                                                                                         torch.bfloat16)):
            raise ValueError(f"--quantization {quantization} is a CPU path for float32 or bfloat16 models; this "
                             f"model is {model.dtype} on {model.device.type}")
        self.quantization = quantization
        self.packed = quantization != "none" or (pack_weights and model.device.type == "cpu"
                                                 and onednn_packs(model.dtype))
        if self.packed:
            linear = {"int8": Int8Linear, "int4": Int4Linear}.get(quantization, PackedLinear)
            if quantization == "int4" and gguf_path is not None:
                linear = self._gguf_int4(model, Path(gguf_path))
            self.qkv = [linear(la.self_attn.q_proj, la.self_attn.k_proj, la.self_attn.v_proj) for la in self.layers]
            self.o_proj = [linear(la.self_attn.o_proj) for la in self.layers]
            self.gate_up = [linear(la.mlp.gate_proj, la.mlp.up_proj) for la in self.layers]
            self.down = [linear(la.mlp.down_proj) for la in self.layers]
            self.head = linear(self.lm_head)
            if release_unpacked:  # the services own their model: keep one copy of each weight, not two
                _release_linear_weights(model)
                for m in [*self.qkv, *self.o_proj, *self.gate_up, *self.down, self.head]:
                    if isinstance(m, Int4Linear):
                        m.release_reference()

    @staticmethod
    def _gguf_int4(model: Any, gguf_path: Path) -> Callable[..., Int4Linear]:
        mapping = map_int4(model, GGUFFile(gguf_path))
        log.info("gguf_int4_mapping", gguf=str(gguf_path), **mapping.summary())
        names = {id(module): name for name, module in model.named_modules()}

        def build(*linears: torch.nn.Linear) -> Int4Linear:
            return Int4Linear(*linears, codes=[mapping.codes.get(names[id(lin)]) for lin in linears])

        return build

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def vocab_size(self) -> int:
        return self.lm_head.weight.shape[0]

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:  # [num_logits, vocab_size] in the model's dtype
        batch = batch.to(self.device)
        hidden = self.hidden_states(batch)
        if batch.logits_indices is not None:
            if batch.logits_indices.numel() == 0:
                return hidden.new_empty((0, self.vocab_size))
            # NOTE: the final norm and lm_head run only on the rows whose logits are needed; prefill rows need
            # none and lm_head is the largest matrix of a small model.
            hidden = hidden[batch.logits_indices]
        return self.logits(self.norm(hidden))

    def logits(self, normed: torch.Tensor) -> torch.Tensor:  # [rows, vocab_size]
        return self.head(normed) if self.packed else self.lm_head(normed)

    @torch.inference_mode()
    def hidden_states(self, batch: ForwardBatch) -> torch.Tensor:  # [num_tokens, hidden], before the final norm
        """Every layer over the batch, whose tensors are on the model's device. With `batch.attention` set
        (static buffers) no host list is read: this is what a CUDA/HIP graph captures."""
        num_tokens = batch.input_ids.numel()
        hidden = self.embed_tokens(batch.input_ids)  # [num_tokens, hidden]
        cos, sin = self.rotary_emb(hidden.unsqueeze(0), batch.positions.unsqueeze(0))  # [1, num_tokens, head_dim]
        cos, sin = cos[0].unsqueeze(1), sin[0].unsqueeze(1)  # [num_tokens, 1, head_dim]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        # block tables etc. built once per forward, not per layer
        meta = batch.attention_metadata(hidden.device) if platform.use_triton(hidden) else batch.attention
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(hidden)
            if self.packed:
                q, k, v = self.qkv[i](h).split([q_size, kv_size, kv_size], dim=1)
            else:
                q, k, v = attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)
            q = q.reshape(num_tokens, self.num_heads, self.head_dim)
            k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
            v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
            if self.qk_norm[i] is not None:
                q, k = self.qk_norm[i][0](q), self.qk_norm[i][1](k)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            key_cache, value_cache = self.kv_cache.key_caches[i], self.kv_cache.value_caches[i]
            write_kv(k, v, key_cache, value_cache, batch.slot_mapping)
            if meta is not None:
                o = paged_attention_tensors(q, key_cache, value_cache, meta.block_tables, meta.query_start,
                                            meta.context_lens, meta.max_query_len, self.scale,
                                            self.sliding_windows[i], tree=meta.tree)
            else:
                o = paged_attention(q, key_cache, value_cache, batch.block_tables, batch.query_start,
                                    batch.context_lens, self.scale, self.sliding_windows[i], tree=batch.tree)
            o = o.reshape(num_tokens, q_size)
            hidden = hidden + self._summed(self.o_proj[i](o) if self.packed else attn.o_proj(o))
            h = layer.post_attention_layernorm(hidden)
            if self.packed:
                gate, up = self.gate_up[i](h).chunk(2, dim=1)
                hidden = hidden + self._summed(self.down[i](layer.mlp.act_fn(gate) * up))
            else:
                hidden = hidden + self._summed(layer.mlp(h))
        return hidden

    def _summed(self, partial: torch.Tensor) -> torch.Tensor:
        """A row-split projection's output: this rank's part summed over the tensor-parallel group."""
        return partial if self.tp is None else self.tp.all_reduce(partial)


def _release_linear_weights(model: Any) -> None:
    tied = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    for layer in model.model.layers:
        for lin in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.self_attn.o_proj,
                    layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj):
            lin.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)
    if not tied:
        model.lm_head.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)


def profile_peak_memory(model: Any, spec: KVCacheSpec, block_size: int, num_tokens: int,
                        device: torch.device, runner_for: Callable[[KVCache], Any] | None = None) -> int:
    """Bytes the process holds at the peak of one forward over `num_tokens` tokens (the largest step), the KV
    pool excluded: weights plus activations. Runs on a throwaway pool just large enough for that step.
    `runner_for`: the runner over a pool (default: the native forward without packing)."""
    num_blocks = -(-num_tokens // block_size)
    kv = KVCache(spec, num_blocks, block_size, device)
    runner = runner_for(kv) if runner_for is not None else PagedCausalLM(model, kv, pack_weights=False)
    batch = ForwardBatch(
        input_ids=torch.zeros(num_tokens, dtype=torch.int64),
        positions=torch.arange(num_tokens, dtype=torch.int64),
        slot_mapping=torch.arange(num_tokens, dtype=torch.int64),
        query_start=[0, num_tokens],
        context_lens=[num_tokens],
        block_tables=[list(range(num_blocks))],
        logits_indices=torch.arange(min(num_tokens, 1024), dtype=torch.int64),  # verification rows of a big step
    )
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    runner.forward(batch)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - kv.num_bytes
    del runner, kv
    torch.cuda.empty_cache()
    return peak
