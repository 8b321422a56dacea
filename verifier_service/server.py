"""Builds the verifier (model, KV pool, engine) and serves it over gRPC with health and reflection."""

from __future__ import annotations

import structlog
from prometheus_client import start_http_server

from common.block_manager import BlockManager
from common.config import parse_dtype
from common.grpc_server import build_grpc_server, serve_until_signal
from common.kv_cache import KVCache, num_blocks_for_budget
from common.model_loading import load_model
from common.paged_model import PagedCausalLM, kv_cache_spec
from specwire.v1 import verifier_pb2, verifier_pb2_grpc, wire
from verifier_service.async_engine import AsyncEngine
from verifier_service.config import VerifierConfig
from verifier_service.engine import VerifierEngine
from verifier_service.metrics import VerifierMetrics
from verifier_service.servicer import VerifierServicer

log = structlog.get_logger(__name__)

SERVICE_NAME = verifier_pb2.DESCRIPTOR.services_by_name["Verifier"].full_name


def build_engine(config: VerifierConfig) -> VerifierEngine:
    loaded = load_model(config.model, parse_dtype(config.dtype))
    spec = kv_cache_spec(loaded.model)
    num_blocks = config.num_blocks or num_blocks_for_budget(spec, config.block_size, config.kv_cache_memory)
    if num_blocks < 1:
        raise ValueError(f"--kv-cache-memory {config.kv_cache_memory} bytes holds no block of {config.block_size} "
                         f"tokens ({spec.bytes_per_token} bytes per token)")
    kv = KVCache(spec, num_blocks, config.block_size)
    log.info("kv_cache", num_blocks=num_blocks, block_size=config.block_size, bytes=kv.num_bytes,
             bytes_per_token=spec.bytes_per_token, capacity_tokens=num_blocks * config.block_size)
    model = PagedCausalLM(loaded.model, kv, release_unpacked=True)
    return VerifierEngine(loaded, model, BlockManager(num_blocks, config.block_size),
                          max_draft_tokens=config.max_draft_tokens,
                          max_num_batched_tokens=config.max_num_batched_tokens)


def verifier_info(engine: VerifierEngine, config: VerifierConfig) -> verifier_pb2.VerifierInfo:
    loaded = engine.loaded
    return verifier_pb2.VerifierInfo(
        model_id=loaded.model_id, vocab_size=loaded.vocab_size, tokenizer_fingerprint=loaded.tokenizer_fingerprint,
        max_draft_tokens=config.max_draft_tokens, block_size=config.block_size, max_model_len=loaded.max_model_len,
        protocol_version=wire.PROTOCOL_VERSION)


async def serve(config: VerifierConfig) -> None:
    engine = build_engine(config)
    metrics = VerifierMetrics()
    async_engine = AsyncEngine(engine, metrics)
    servicer = VerifierServicer(async_engine, verifier_info(engine, config))
    server = build_grpc_server(
        config.host, config.port, service_names=(SERVICE_NAME,), options=wire.SERVER_OPTIONS,
        add_servicers=lambda s: verifier_pb2_grpc.add_VerifierServicer_to_server(servicer, s))
    if config.metrics_port:
        start_http_server(config.metrics_port, addr=config.host, registry=metrics.registry)
    async_engine.start()
    await server.start()
    log.info("verifier_ready", address=f"{config.host}:{server.port}", model=engine.loaded.model_id,
             vocab_size=engine.loaded.vocab_size, metrics_port=config.metrics_port or None)
    await serve_until_signal(server, on_stop=async_engine.stop)
