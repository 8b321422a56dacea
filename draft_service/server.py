"""Builds the draft service (draft model, its KV cache, the verifier link) and serves Generate over gRPC."""

from __future__ import annotations

import asyncio

import structlog
from grpc_health.v1 import health, health_pb2

from common.block_manager import BlockManager
from common.compute_thread import compute_thread
from common.config import parse_dtype
from common.device import describe_device, resolve_device, resolve_dtype_name
from common.errors import ErrorCode, ServiceError
from common.grpc_server import build_grpc_server, serve_until_stopped, write_port_file
from common.kv_cache import KVCache, num_blocks_for_budget
from common.metrics_http import start_metrics_server
from common.model_impl import build_paged_model, paged_kv_spec
from common.model_loading import LoadedModel, load_model, load_tokenizer
from common.static_forward import build_static_forward
from common.tokenizer import tokenizer_fingerprint
from draft_service.batcher import DraftBatcher
from draft_service.config import DraftConfig
from draft_service.draft_model import DraftModel
from draft_service.drafters import Drafter, ModelDrafter, NgramDrafter
from draft_service.due_rounds import DueRounds
from draft_service.generation import Generator
from draft_service.link_security import LinkSecurity
from draft_service.metrics import DraftMetrics
from draft_service.servicer import DraftServicer
from draft_service.tree_drafting import TreeShape
from draft_service.verifier_link import VerifierLink
from specwire.v1 import draft_pb2, draft_pb2_grpc, wire

log = structlog.get_logger(__name__)

SERVICE_NAME = draft_pb2.DESCRIPTOR.services_by_name["Draft"].full_name


VERIFIER_WATCH_S = 1.0


async def track_verifier(link: VerifierLink, servicer: health.aio.HealthServicer) -> None:
    """The health of SERVICE_NAME follows the Verify streams: SERVING while a verifier takes new sequences (up, not
    draining), NOT_SERVING otherwise (the process itself, health "", stays SERVING: requests wait
    --verifier-retry-deadline for a verifier).
    Down streams are reconnected from here too, without waiting for a request, and a dns:/// target is resolved
    again."""
    status = None
    while True:
        await link.refresh()
        link.reconnect_in_background()
        serving = link.can_place
        now = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        if now != status:
            await servicer.set(SERVICE_NAME, now)
            if status is not None:
                log.info("verifier_health", connected=link.connected, can_place=serving)
            status = now
        await asyncio.sleep(VERIFIER_WATCH_S)


class HandshakeRefused(RuntimeError):
    """The verifier refused this draft (tokenizer or vocabulary mismatch, a refused token): retrying cannot
    help."""


async def connect_at_start(link: VerifierLink, timeout_s: float) -> None:
    """Wait for the verifier (it may still be loading its model); a refused handshake ends the wait at once."""
    try:
        await link.ensure_connected(timeout_s)
    except ServiceError as err:
        if err.code in (ErrorCode.FAILED_PRECONDITION, ErrorCode.UNAUTHENTICATED, ErrorCode.PERMISSION_DENIED):
            raise HandshakeRefused(err.message) from err
        raise


def build_draft_model(config: DraftConfig, metrics: DraftMetrics | None = None) -> tuple[LoadedModel, DraftModel]:
    device = resolve_device(config.device)
    dtype = resolve_dtype_name(config.dtype, device)
    loaded = load_model(config.model, parse_dtype(dtype), device, config.model_impl)
    spec = paged_kv_spec(loaded)
    num_blocks = max(1, num_blocks_for_budget(spec, config.block_size, config.kv_cache_memory))
    kv = KVCache(spec, num_blocks, config.block_size, device)
    runner = build_paged_model(loaded, kv, quantization=config.quantization)
    info = describe_device(device)
    log.info("draft_model", device=info.device, device_name=info.name, platform=info.platform, dtype=dtype,
             kv_blocks=num_blocks, capacity_tokens=num_blocks * config.block_size)
    static = build_static_forward(runner, max_tokens=min(config.cuda_graph_max_tokens, config.max_num_batched_tokens),
                                  max_model_len=loaded.max_model_len,
                                  block_size=config.block_size, graphs=config.cuda_graphs)
    model = DraftModel(runner, BlockManager(num_blocks, config.block_size), config.q_max_support, static,
                       on_static_step=metrics.static_steps.inc if metrics else None,
                       max_num_batched_tokens=config.max_num_batched_tokens,
                       on_rows=metrics.count_model_rows if metrics else None)
    return loaded, model


async def serve(config: DraftConfig, *, stop: asyncio.Event | None = None) -> None:
    """Serve until SIGINT or SIGTERM, or until `stop` is set (see serve_until_stopped)."""
    batcher: DraftBatcher | None = None
    due: DueRounds | None = None  # with a draft model: the batches wait for the rounds whose verdicts are in
    drafter: Drafter
    metrics = DraftMetrics()
    if config.proposer == "ngram":  # prompt lookup: the tokenizer is all it needs
        tokenizer = load_tokenizer(config.model)
        model_id, vocab_size, fingerprint = f"ngram:{config.model}", None, tokenizer_fingerprint(tokenizer)
        drafter = NgramDrafter()
    else:
        executor = compute_thread("draft-model")  # the model loads on the thread that runs it
        loaded, model = await asyncio.get_running_loop().run_in_executor(executor, build_draft_model, config,
                                                                          metrics)
        due = DueRounds()
        batcher = DraftBatcher(model, executor, due)
        tokenizer, model_id, vocab_size = loaded.tokenizer, loaded.model_id, loaded.vocab_size
        fingerprint = loaded.tokenizer_fingerprint
        tree = TreeShape(config.num_speculative_tokens, config.tree_branches, config.tree_nodes) \
            if config.tree_branches > 1 else None
        drafter = ModelDrafter(batcher, config.draft_confidence_threshold, tree, calibrate=config.tree_calibration,
                               metrics=metrics)
    security = LinkSecurity.from_files(tls=config.verifier_uses_tls, ca=config.verifier_tls_ca,
                                       cert=config.verifier_tls_cert, key=config.verifier_tls_key,
                                       server_name=config.verifier_tls_server_name,
                                       token_file=config.verifier_token_file)
    link = VerifierLink(config.verifier, draft_model_id=model_id, vocab_size=vocab_size,
                        tokenizer_fingerprint=fingerprint, security=security, on_reconnect=metrics.reconnects.inc,
                        metrics=metrics)
    if isinstance(drafter, ModelDrafter) and drafter.tree is not None:
        # a sequence resumed on a verifier that takes no trees as large goes on with chains
        drafter.trees_allowed = lambda: link.identity is not None and link.identity.takes_trees(config.tree_nodes)
    await connect_at_start(link, config.connect_timeout_s)
    if batcher is not None:
        batcher.start()
    generator = Generator(config, tokenizer, link.identity.vocab_size, link, drafter, metrics, due)
    if due is not None:
        link.on_verdict = generator.verdict_arrived
    metrics_server = None
    if config.metrics_port:
        metrics_server = start_metrics_server(config.metrics_port, config.host, metrics.registry)
    servicer = DraftServicer(generator)
    server = build_grpc_server(config.host, config.port, service_names=(SERVICE_NAME,), options=wire.DRAFT_SERVER_OPTIONS, security=config,
                               add_servicers=lambda s: draft_pb2_grpc.add_DraftServicer_to_server(servicer, s))
    await server.start()
    write_port_file(config.port_file, server.port)
    watcher = asyncio.create_task(track_verifier(link, server.health), name="verifier-health")
    log.info("draft_ready", address=f"{config.host}:{server.port}", model=model_id, verifier=config.verifier,
             proposer=config.proposer, num_speculative_tokens=config.num_speculative_tokens,
             speculation=config.speculation_mode, wire_mode=config.wire_mode, tls=bool(config.tls_cert),
             mutual_tls=bool(config.tls_client_ca), tokens_required=bool(config.auth_token_file),
             verifier_tls=config.verifier_uses_tls)

    async def stop_draft() -> None:
        try:
            watcher.cancel()
            generator.prompts.close()
            if batcher is not None:
                await batcher.stop()
            await link.close()
        finally:
            if metrics_server is not None:
                await asyncio.to_thread(metrics_server.close)

    await serve_until_stopped(server, on_stop=stop_draft, stop=stop, grace_s=config.drain_grace_s)
