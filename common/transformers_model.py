"""The transformers modeling backend (`--model-impl transformers`): any decoder-only architecture transformers
has, with transformers' own modules computing each layer and specwire owning only attention and the KV cache.

transformers dispatches attention through a registry (`transformers.AttentionInterface`): a model whose modeling
file sets `_supports_attention_backend` calls the function registered under its `config._attn_implementation`
with q, k and v after the model's own projections, norms and RoPE variant, the attention module (`layer_idx`,
`scaling`) and the layer's `sliding_window`, `softcap` and attention sinks (`s_aux`) where the model has them,
plus every keyword argument given to the model's forward. specwire registers `specwire_paged`: it writes the
step's K and V into the paged pool by slot and runs kernels.paged_attention over it, with the paging metadata of
the step passed through the forward's keyword arguments. transformers builds no mask for an implementation it
does not know, so no [tokens, tokens] mask is ever made. The step is one flattened sequence of every scheduled
sequence's tokens (batch size 1), with each token's own position.

What this cannot serve, refused at load (`check_supported`): encoder-decoders, multimodal models (no causal LM
head of their own), architectures whose modeling file does not dispatch attention through the interface, and
recurrent or hybrid layers (state that is not a KV cache: Mamba, linear attention, convolutions).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import structlog
import torch

from common.cpu_linear import PackedLinear, onednn_packs
from common.kv_cache import KVCache, KVCacheSpec, LayerShape
from common.tensor_parallel import TensorParallel, sum_row_split_outputs
from kernels import platform
from kernels.kv_cache_write import write_kv
from kernels.paged_attention import (
    AttentionMetadata,
    TreeMask,
    paged_attention,
    paged_attention_tensors,
)

log = structlog.get_logger(__name__)

ATTENTION_NAME = "specwire_paged"
CONTEXT_KWARG = "specwire_paged"  # the forward's keyword argument that carries a _PagedContext
# layer kinds (config.layer_types) that are attention over a KV cache; anything else is a recurrent or hybrid layer
ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "chunked_attention", "attention"})
# model types known to carry state that is not a KV cache (checked before loading the weights)
RECURRENT_MODEL_TYPES = frozenset({
    "mamba", "mamba2", "jamba", "zamba", "zamba2", "bamba", "falcon_h1", "falcon_mamba", "granitemoehybrid",
    "nemotron_h", "lfm2", "lfm2_moe", "qwen3_next", "recurrent_gemma", "rwkv", "minimax", "plamo2", "xlstm",
    "kimi_linear", "olmo3_2_hybrid",
})


# keyword arguments a model may hand its attention that carry semantics specwire's attention does not implement
IGNORED_SEMANTICS = frozenset({"position_bias", "attention_bias", "head_mask", "indices", "alibi"})


class UnsupportedModelError(ValueError):
    """The model cannot be served by specwire, and why."""


def dynamic_rope_types(config: Any) -> list[str]:
    """The RoPE types of the config that choose their frequencies from the longest position in the forward
    (dynamic NTK, Phi-3's longrope): in a flattened batch of several sequences one sequence's logits would depend
    on the others', and chunked prefill would cache keys under two frequency sets."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    groups = params.values() if all(isinstance(v, dict) for v in params.values()) and params else [params]
    kinds = [str(g.get("rope_type") or g.get("type") or "") for g in groups if isinstance(g, dict)]
    return sorted({k for k in kinds if "dynamic" in k or k == "longrope"})


def check_rope(config: Any) -> None:
    dynamic = dynamic_rope_types(config)
    if dynamic:
        raise UnsupportedModelError(
            f"model type {getattr(config, 'model_type', '?')!r} uses RoPE type {', '.join(dynamic)}, whose "
            "frequencies follow the longest position in the forward pass: in a batch of sequences one's logits "
            "would depend on another's, which breaks lossless verification. Use a checkpoint (or a config) with a "
            "static RoPE type (default, linear, llama3, yarn)")


@dataclass
class _PagedContext:
    """One step's paging metadata, read by every layer's attention call."""

    kv_cache: KVCache
    slot_mapping: torch.Tensor  # [num_tokens]
    block_tables: list[list[int]]
    query_start: list[int]
    context_lens: list[int]
    meta: AttentionMetadata | None  # the Triton path's metadata on the device; None: the torch path's lists
    tree: TreeMask | None = None  # token trees (host side, for the torch path)


@dataclass
class _ShapeProbe:
    """Records each attention layer's K and V shapes (one token through the model at load), and what the model
    asks of its attention that specwire's does not do."""

    shapes: dict[int, LayerShape]
    problems: list[str]


def paged_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, scaling: float | None = None,
                            dropout: float = 0.0, sliding_window: int | None = None, softcap: float | None = None,
                            s_aux: torch.Tensor | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: query [1, heads, tokens, head_dim], key and value [1, kv_heads, tokens,
    head_dim (of each)]; returns [1, tokens, heads, v_head_dim]. The keys and values are written into the pool
    before attention reads it, so a token attends to itself and to what earlier steps cached."""
    context = kwargs.get(CONTEXT_KWARG)
    layer = getattr(module, "layer_idx", None)
    if isinstance(context, _ShapeProbe):
        name = type(module).__name__
        if layer is None:
            context.problems.append(f"{name} has no layer_idx (the KV pool is indexed by layer)")
        elif int(layer) in context.shapes:
            context.problems.append(f"layer {layer} computes attention twice in one forward (a shared or looped "
                                    "layer would overwrite its own cache slots)")
        else:
            context.shapes[int(layer)] = LayerShape(key.shape[1], key.shape[3], value.shape[3])
        if attention_mask is not None:
            context.problems.append(f"{name} builds an attention mask of its own, which specwire's paged "
                                    "attention (causal, optionally windowed) would ignore")
        if getattr(module, "is_causal", True) is False or kwargs.get("is_causal") is False:
            context.problems.append(f"{name} is bidirectional (is_causal=False); specwire serves causal decoders")
        ignored = sorted(IGNORED_SEMANTICS & {k for k, v in kwargs.items() if v is not None})
        if ignored:
            context.problems.append(f"{name} passes {', '.join(ignored)} to its attention, which specwire's paged "
                                    "attention does not implement")
        return query.new_zeros(1, query.shape[2], query.shape[1], value.shape[3]), None
    if not isinstance(context, _PagedContext):
        raise RuntimeError("specwire's paged attention was called without the step's paging metadata: this model "
                           "was loaded for specwire's transformers backend and runs only through it")
    if query.shape[0] != 1:
        raise ValueError(f"specwire's paged attention takes one flattened batch, got batch size {query.shape[0]}")
    q = query[0].transpose(0, 1)  # [tokens, heads, head_dim]
    k = key[0].transpose(0, 1)
    v = value[0].transpose(0, 1)
    key_cache, value_cache = context.kv_cache.key_caches[layer], context.kv_cache.value_caches[layer]
    write_kv(k, v, key_cache, value_cache, context.slot_mapping)
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    window = sliding_window or None
    sinks = s_aux
    meta = context.meta
    if meta is not None:
        o = paged_attention_tensors(q, key_cache, value_cache, meta.block_tables, meta.query_start,
                                    meta.context_lens, meta.max_query_len, scale, window, softcap=softcap,
                                    sinks=sinks, tree=meta.tree)
    else:
        o = paged_attention(q, key_cache, value_cache, context.block_tables, context.query_start,
                            context.context_lens, scale, window, softcap=softcap, sinks=sinks, tree=context.tree)
    return o.unsqueeze(0), None


def register_attention() -> None:
    """Make `specwire_paged` a transformers attention implementation (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)


# -- what can be served ---------------------------------------------------------------------------------------

def check_config(config: Any) -> None:
    """Refuse, before the weights load, what this backend cannot serve, saying why."""
    model_type = getattr(config, "model_type", "?")
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"model type {model_type!r} is an encoder-decoder; specwire serves decoder-only "
                                    "causal LMs (its KV cache holds one causal stream per sequence)")
    for sub in ("vision_config", "audio_config", "speech_config", "vision_tower"):
        if getattr(config, sub, None) is not None:
            raise UnsupportedModelError(
                f"model type {model_type!r} is multimodal ({sub}); specwire serves text-only decoders: use the "
                "model's text-only checkpoint (e.g. a *_text model type) if it has one")
    if model_type in RECURRENT_MODEL_TYPES:
        raise UnsupportedModelError(f"model type {model_type!r} has recurrent or hybrid layers whose state is not a "
                                    "KV cache; specwire's paged cache and rollback of rejected drafts cover "
                                    "attention layers only")
    layer_types = getattr(config, "layer_types", None) or []
    odd = sorted({t for t in layer_types if t not in ATTENTION_LAYER_TYPES})
    if odd:
        raise UnsupportedModelError(f"model type {model_type!r} has layers of kind {', '.join(odd)}: recurrent or "
                                    "hybrid layers keep state that is not a KV cache, which specwire cannot page "
                                    "or roll back")
    check_rope(config)
    if any(t == "chunked_attention" for t in layer_types):
        raise UnsupportedModelError(f"model type {model_type!r} uses chunked attention, which specwire's paged "
                                    "attention does not implement")


def check_model(model: Any) -> None:
    """Refuse a loaded model whose modeling file cannot route attention through specwire."""
    model_type = getattr(model.config, "model_type", "?")
    if not getattr(model, "_supports_attention_backend", False):
        raise UnsupportedModelError(
            f"model type {model_type!r}: its transformers modeling file does not dispatch attention through "
            "transformers' AttentionInterface (_supports_attention_backend is not set), so specwire cannot put "
            "its paged KV cache under it")


# -- the runner -----------------------------------------------------------------------------------------------

class _PackedLinearModule(torch.nn.Module):
    """An nn.Linear's drop-in on CPU: its weight reordered once for oneDNN (common.cpu_linear.PackedLinear: several
    times faster than aten for the few rows of a decoding step, and a step of fewer rows padded to MIN_ROWS, so a
    token's logits do not depend on the block it is verified in). Any leading dims, as nn.Linear takes."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.inner = PackedLinear(linear)
        # what modeling code may read from a Linear (its dtype and device); the float weights are not kept
        self.weight = torch.nn.Parameter(torch.empty(0, dtype=linear.weight.dtype, device=linear.weight.device),
                                         requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x.reshape(-1, self.in_features)).reshape(*x.shape[:-1], self.out_features)


def pack_linears(model: Any) -> int:
    """Replace every nn.Linear of the model (lm_head included; MoE experts are not Linear modules and stay) with
    its packed drop-in. Returns how many were replaced."""
    targets = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if type(child) is torch.nn.Linear]
    for parent, name, child in targets:
        setattr(parent, name, _PackedLinearModule(child))
    return len(targets)


def kv_cache_spec_by_probe(model: Any) -> KVCacheSpec:
    """Each layer's K and V shapes, as the model's own attention calls show them for one token: exact for any
    architecture (per-layer head counts and head dims, different K and V head dims). Every decoder layer must
    call attention through the interface; one that does not is a recurrent or hybrid layer."""
    probe = _ShapeProbe({}, [])
    ids = torch.zeros((1, 1), dtype=torch.int64, device=model.device)
    with torch.inference_mode():
        model(input_ids=ids, position_ids=ids, use_cache=False, logits_to_keep=1, **{CONTEXT_KWARG: probe})
    if probe.problems:
        raise UnsupportedModelError(f"model type {model.config.model_type!r}: " + "; ".join(dict.fromkeys(
            probe.problems)))
    num_layers = int(model.config.num_hidden_layers)
    missing = [i for i in range(num_layers) if i not in probe.shapes]
    if missing:
        raise UnsupportedModelError(
            f"model type {model.config.model_type!r}: layers {missing} compute no attention through transformers' "
            "AttentionInterface (recurrent or hybrid layers, or a shared KV cache), so specwire cannot page them")
    return KVCacheSpec.from_layers([probe.shapes[i] for i in range(num_layers)], model.dtype)


class TransformersPagedLM:
    """The same interface as common.paged_model.PagedCausalLM (forward over a ForwardBatch; hidden_states, norm
    and logits for the static path), over a transformers model loaded with attention `specwire_paged`."""

    quantization = "none"
    model_impl = "transformers"

    def __init__(self, model: Any, kv_cache: KVCache, *, pack_weights: bool = True,
                 tp: TensorParallel | None = None) -> None:
        """pack_weights: on CPU in float32 or bfloat16, every nn.Linear becomes a oneDNN-packed drop-in (the
        native path packs the same way); the model is changed in place. tp: this rank's place in a
        tensor-parallel group; the model was cut to its share (common.tensor_parallel.shard_model), and kv_cache
        sized by a probe of the cut model."""
        check_model(model)
        register_attention()
        model.set_attn_implementation(ATTENTION_NAME)
        self.model = model
        self.kv_cache = kv_cache
        head = model.get_output_embeddings()  # packed already when another runner shares this model
        self._vocab_size = head.out_features if isinstance(head, _PackedLinearModule) else head.weight.shape[0]
        self.packed = pack_weights and model.device.type == "cpu" and onednn_packs(model.dtype)
        if self.packed:
            log.info("transformers_packed_linears", count=pack_linears(model))
        if tp is not None:
            sum_row_split_outputs(model, tp)
        self.lm_head = model.get_output_embeddings()
        self.embed_tokens = model.get_input_embeddings()
        self.base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
        self.norm = torch.nn.Identity()  # the decoder's output is already normed
        self._static_head = self._head_matches()

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def supports_static(self) -> bool:
        """Whether decoder output + lm_head (+ the logit transforms `logits` knows) gives the model's own logits,
        which the static path needs; otherwise every step takes the full forward."""
        return self._static_head

    def _context(self, batch: Any, kv_cache: KVCache | None = None) -> _PagedContext:
        """The step's paging metadata over `kv_cache` (default: the runner's pool)."""
        meta = batch.attention_metadata(self.device) if platform.use_triton(self.embed_tokens.weight) else \
            batch.attention
        return _PagedContext(kv_cache or self.kv_cache, batch.slot_mapping, batch.block_tables, batch.query_start,
                             batch.context_lens, meta, batch.tree)

    @torch.inference_mode()
    def forward(self, batch: Any) -> torch.Tensor:  # [num_logits, vocab_size]
        """The model's own forward (its logit softcap or scaling included), logits only for the wanted rows."""
        batch = batch.to(self.device)
        keep = batch.logits_indices if batch.logits_indices is not None else 0
        if isinstance(keep, torch.Tensor) and keep.numel() == 0:  # a prefill chunk: its K and V, no logits
            self.hidden_states(batch)
            return torch.empty((0, self.vocab_size), dtype=self.model.dtype, device=self.device)
        out = self.model(input_ids=batch.input_ids.unsqueeze(0), position_ids=batch.positions.unsqueeze(0),
                         use_cache=False, logits_to_keep=keep, **{CONTEXT_KWARG: self._context(batch)})
        return out.logits[0]

    @torch.inference_mode()
    def hidden_states(self, batch: Any) -> torch.Tensor:  # [num_tokens, hidden], after the final norm
        out = self.base(input_ids=batch.input_ids.unsqueeze(0), position_ids=batch.positions.unsqueeze(0),
                        use_cache=False, **{CONTEXT_KWARG: self._context(batch)})
        return out.last_hidden_state[0]

    @torch.inference_mode()
    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(normed)
        config = self.model.config
        cap = getattr(config, "final_logit_softcapping", None)
        if cap:
            logits = torch.tanh(logits / cap) * cap
        scaling = getattr(config, "logits_scaling", None)  # granite divides
        if scaling:
            logits = logits / scaling
        return logits

    def _head_matches(self) -> bool:
        """One probe token both ways: the model's own logits against decoder + `logits`. A model that does
        something else to its logits keeps the full forward for every step."""
        n = 4  # a few tokens, some of them common ones, so that transformed logits are not all near zero
        block = self.kv_cache.block_size
        num_blocks = -(-n // block)
        cache = KVCache(self.kv_cache.spec, num_blocks, block, self.device)
        ids = torch.randint(0, self._vocab_size, (n,), generator=torch.Generator().manual_seed(0)).to(self.device)
        positions = torch.arange(n, device=self.device)
        from common.paged_model import ForwardBatch

        batch = ForwardBatch(ids, positions, positions, [0, n], [n], [list(range(num_blocks))], None)
        context = self._context(batch, cache)  # slots 0..n-1 of the probe's own pool
        with torch.inference_mode():
            full = self.model(input_ids=ids[None], position_ids=positions[None], use_cache=False,
                              **{CONTEXT_KWARG: context}).logits[0]
            hidden = self.base(input_ids=ids[None], position_ids=positions[None], use_cache=False,
                               **{CONTEXT_KWARG: context}).last_hidden_state[0]
            split = self.logits(hidden)
        same = bool(torch.allclose(full.float(), split.float(), rtol=1e-3, atol=1e-3))
        if not same:
            log.info("transformers_static_off", reason="the model's logits are not lm_head over the decoder output")
        return same
