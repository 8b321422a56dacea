"""The model runner a loaded model gets: specwire's native forward (common.paged_model) or transformers' own
modules over specwire's paged attention (common.transformers_model), as LoadedModel.model_impl says. Both take a
ForwardBatch and return the wanted rows' logits; the services see no difference."""

from __future__ import annotations

from common.kv_cache import KVCache, KVCacheSpec
from common.model_loading import LoadedModel
from common.paged_model import PagedCausalLM, kv_cache_spec
from common.tensor_parallel import TensorParallel
from common.transformers_model import TransformersPagedLM, kv_cache_spec_by_probe

PagedModel = PagedCausalLM | TransformersPagedLM


def paged_kv_spec(loaded: LoadedModel) -> KVCacheSpec:
    """The KV pool's per-layer shapes: from the config on the native path, from the model's own attention calls
    on the transformers backend (per-layer head dims, K and V head dims that differ)."""
    if loaded.model_impl == "transformers":
        return kv_cache_spec_by_probe(loaded.model)
    return kv_cache_spec(loaded.model)


def build_paged_model(loaded: LoadedModel, kv: KVCache, *, quantization: str = "none",
                      release_unpacked: bool = True, tp: TensorParallel | None = None) -> PagedModel:
    if loaded.model_impl == "transformers":
        if quantization != "none":
            raise ValueError(f"--quantization {quantization} is a path of the native implementation; "
                             f"{loaded.model.config.model_type!r} runs on the transformers backend")
        return TransformersPagedLM(loaded.model, kv, tp=tp)
    return PagedCausalLM(loaded.model, kv, release_unpacked=release_unpacked, quantization=quantization,
                         gguf_path=loaded.gguf_path, tp=tp)
