"""Builds the verifier (model, KV pool, engine) and serves it over gRPC with health and reflection."""

from __future__ import annotations

import asyncio
import signal

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server

from common.block_manager import BlockManager
from common.config import parse_dtype
from common.kv_cache import KVCache, num_blocks_for_budget
from common.model_loading import load_model
from common.paged_model import PagedCausalLM, kv_cache_spec
from specwire.v1 import verifier_pb2, verifier_pb2_grpc
from verifier_service.config import VerifierConfig
from verifier_service.engine import VerifierEngine
from verifier_service.metrics import VerifierMetrics
from verifier_service.scheduler import Scheduler
from verifier_service.servicer import PROTOCOL_VERSION, VerifierServicer

log = structlog.get_logger(__name__)

SERVICE_NAME = verifier_pb2.DESCRIPTOR.services_by_name["Verifier"].full_name
GRPC_OPTIONS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]


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
    return VerifierEngine(loaded, PagedCausalLM(loaded.model, kv, release_unpacked=True), BlockManager(num_blocks, config.block_size),
                          max_draft_tokens=config.max_draft_tokens,
                          max_num_batched_tokens=config.max_num_batched_tokens)


def verifier_info(engine: VerifierEngine, config: VerifierConfig) -> verifier_pb2.VerifierInfo:
    loaded = engine.loaded
    return verifier_pb2.VerifierInfo(
        model_id=loaded.model_id, vocab_size=loaded.vocab_size, tokenizer_fingerprint=loaded.tokenizer_fingerprint,
        max_draft_tokens=config.max_draft_tokens, block_size=config.block_size, max_model_len=loaded.max_model_len,
        protocol_version=PROTOCOL_VERSION)


async def serve(config: VerifierConfig) -> None:
    engine = build_engine(config)
    metrics = VerifierMetrics()
    scheduler = Scheduler(engine, metrics)
    server = grpc.aio.server(options=GRPC_OPTIONS)
    verifier_pb2_grpc.add_VerifierServicer_to_server(VerifierServicer(scheduler, verifier_info(engine, config)), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    port = server.add_insecure_port(f"{config.host}:{config.port}")
    if port == 0:
        raise OSError(f"cannot bind {config.host}:{config.port}")
    if config.metrics_port:
        start_http_server(config.metrics_port, addr=config.host, registry=metrics.registry)
    await server.start()
    scheduler.start()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("verifier_ready", address=f"{config.host}:{port}", model=engine.loaded.model_id,
             vocab_size=engine.vocab_size, metrics_port=config.metrics_port or None)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        log.info("verifier_stopping")
        await health_servicer.enter_graceful_shutdown()
        await server.stop(grace=2.0)
        await scheduler.stop()
