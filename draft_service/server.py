"""Builds the draft service (draft model, its KV cache, the verifier link) and serves Generate over gRPC."""

from __future__ import annotations

import asyncio
import time

import structlog
from prometheus_client import start_http_server

from common.block_manager import BlockManager
from common.config import parse_dtype
from common.device import describe_device, resolve_device, resolve_dtype_name
from common.errors import ErrorCode, ServiceError
from common.grpc_server import build_grpc_server, serve_until_signal
from common.kv_cache import KVCache, num_blocks_for_budget
from common.model_loading import load_model, load_tokenizer
from common.paged_model import PagedCausalLM, kv_cache_spec
from common.tokenizer import tokenizer_fingerprint
from draft_service.config import DraftConfig
from draft_service.drafters import Drafter, ModelDrafter, NgramDrafter
from draft_service.generation import Generator
from draft_service.metrics import DraftMetrics
from draft_service.proposer import DraftModel, Proposer
from draft_service.servicer import DraftServicer
from draft_service.verifier_link import VerifierLink
from specwire.v1 import draft_pb2, draft_pb2_grpc, wire

log = structlog.get_logger(__name__)

SERVICE_NAME = draft_pb2.DESCRIPTOR.services_by_name["Draft"].full_name


class HandshakeRefused(RuntimeError):
    """The verifier refused this draft (tokenizer or vocabulary mismatch): retrying cannot help."""


async def connect_with_retry(link: VerifierLink, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            await link.connect(timeout_s=min(10.0, max(1.0, deadline - time.monotonic())))
            return
        except ServiceError as err:
            if err.code is ErrorCode.FAILED_PRECONDITION:
                raise HandshakeRefused(err.message) from err
            if time.monotonic() > deadline:
                raise
            log.warning("verifier_not_ready", message=err.message)
            await asyncio.sleep(1.0)


async def serve(config: DraftConfig) -> None:
    proposer: Proposer | None = None
    drafter: Drafter
    if config.proposer == "ngram":  # prompt lookup: the tokenizer is all it needs
        tokenizer = load_tokenizer(config.model)
        model_id, vocab_size, fingerprint = f"ngram:{config.model}", None, tokenizer_fingerprint(tokenizer)
        drafter = NgramDrafter()
    else:
        device = resolve_device(config.device)
        dtype = resolve_dtype_name(config.dtype, device)
        loaded = load_model(config.model, parse_dtype(dtype), device)
        spec = kv_cache_spec(loaded.model)
        num_blocks = max(1, num_blocks_for_budget(spec, config.block_size, config.kv_cache_memory))
        kv = KVCache(spec, num_blocks, config.block_size, device)
        runner = PagedCausalLM(loaded.model, kv, release_unpacked=True)
        info = describe_device(device)
        log.info("draft_model", device=info.device, device_name=info.name, platform=info.platform, dtype=dtype,
                 kv_blocks=num_blocks, capacity_tokens=num_blocks * config.block_size)
        proposer = Proposer(DraftModel(runner, BlockManager(num_blocks, config.block_size), config.q_max_support))
        tokenizer, model_id, vocab_size = loaded.tokenizer, loaded.model_id, loaded.vocab_size
        fingerprint = loaded.tokenizer_fingerprint
        drafter = ModelDrafter(proposer, config.draft_confidence_threshold)
    link = VerifierLink(config.verifier, draft_model_id=model_id, vocab_size=vocab_size,
                        tokenizer_fingerprint=fingerprint)
    await connect_with_retry(link, config.connect_timeout_s)
    if proposer is not None:
        proposer.start()
    metrics = DraftMetrics()
    generator = Generator(config, tokenizer, link.identity.vocab_size, link, drafter, metrics)
    if config.metrics_port:
        start_http_server(config.metrics_port, addr=config.host, registry=metrics.registry)
    servicer = DraftServicer(generator)
    server = build_grpc_server(config.host, config.port, service_names=(SERVICE_NAME,), options=wire.SERVER_OPTIONS,
                               add_servicers=lambda s: draft_pb2_grpc.add_DraftServicer_to_server(servicer, s))
    await server.start()
    log.info("draft_ready", address=f"{config.host}:{server.port}", model=model_id, verifier=config.verifier,
             proposer=config.proposer, num_speculative_tokens=config.num_speculative_tokens,
             adaptive_k=config.adaptive_k, wire_mode=config.wire_mode)

    async def stop_draft() -> None:
        if proposer is not None:
            await proposer.stop()
        await link.close()

    await serve_until_signal(server, on_stop=stop_draft)
