"""Builds the verifier (model, KV pool, engine) and serves it over gRPC with health and reflection."""

from __future__ import annotations

import asyncio
import tempfile
import threading

import structlog
import torch
from grpc_health.v1 import health_pb2

from common.block_manager import BlockManager
from common.compute_thread import compute_thread
from common.config import parse_dtype
from common.device import describe_device, kv_budget_from_utilization, resolve_device, resolve_dtype_name
from common.grpc_server import build_grpc_server, serve_until_stopped, write_port_file
from common.kv_cache import KVCache, KVCacheSpec, num_blocks_for_budget
from common.metrics_http import start_metrics_server
from common.model_impl import PagedModel, build_paged_model, paged_kv_spec
from common.model_loading import LoadedModel, load_model
from common.paged_model import PagedCausalLM, profile_peak_memory
from common.static_forward import StaticForward, build_static_forward
from common.tensor_parallel import TensorParallel, shard_model, sharded_spec
from specwire.v1 import verifier_pb2, verifier_pb2_grpc, wire
from verifier_service import tensor_parallel
from verifier_service.async_engine import AsyncEngine
from verifier_service.config import CPU_KV_CACHE_MEMORY, VerifierConfig
from verifier_service.engine import VerifierEngine
from verifier_service.metrics import VerifierMetrics
from verifier_service.servicer import VerifierServicer
from verifier_service.stream_outbox import StreamLimits

log = structlog.get_logger(__name__)

SERVICE_NAME = verifier_pb2.DESCRIPTOR.services_by_name["Verifier"].full_name


def build_engine(config: VerifierConfig) -> VerifierEngine:
    device = resolve_device(config.device)
    dtype = resolve_dtype_name(config.dtype, device)
    tp = workers = None
    stopping = threading.Event()
    try:
        if config.tensor_parallel_size > 1:  # this process is rank 0; the others start now and join it
            tensor_parallel.check_devices(device, config.tensor_parallel_size)
            rendezvous = tempfile.mkdtemp(prefix="specwire-tp-")
            init_method = f"file://{rendezvous}/rendezvous"
            workers = tensor_parallel.start_workers(config, init_method, stopping)
            device = tensor_parallel.rank_device(device, 0)
            tp = tensor_parallel.init_rank(0, config.tensor_parallel_size, init_method, device)
        loaded, model, static = build_model_runner(config, device, dtype, tp)
    except BaseException:
        stopping.set()  # the start failed here (its error is the one to report): the other ranks end with it
        raise
    if tp is not None:
        model = tensor_parallel.LeaderModel(model, tp, workers, device, stopping)
    return VerifierEngine(loaded, model, BlockManager(model.kv_cache.num_blocks, config.block_size), static=static,
                          max_draft_tokens=config.max_draft_tokens,
                          max_num_batched_tokens=config.max_num_batched_tokens, dtype=dtype,
                          sequence_idle_timeout_s=config.sequence_idle_timeout_s,
                          max_sequences_per_stream=config.max_sequences_per_stream,
                          max_sequences=config.max_sequences, max_waiting_tokens=config.max_waiting_tokens,
                          max_q_support=config.max_q_support, max_tree_nodes=config.max_tree_nodes,
                          goodput=config.goodput, goodput_switch_tolerance=config.goodput_switch_tolerance,
                          goodput_plain_margin=config.goodput_plain_margin,
                          goodput_defer_tolerance=config.goodput_defer_tolerance,
                          speculation_trial=config.speculation_trial)


def build_model_runner(config: VerifierConfig, device: torch.device, dtype: str,
                       tp: TensorParallel | None = None) -> tuple[LoadedModel, PagedModel, StaticForward | None]:
    """The target, its KV pool and its runner (and static buffers); with `tp`, this rank's share of each (every
    rank runs this, in step: the sizing forward on a GPU has the group's all-reduces)."""
    def load_and_cut() -> LoadedModel:
        loaded = load_model(config.model, parse_dtype(dtype), device if tp is None else "cpu", config.model_impl)
        if tp is not None:
            check_tensor_parallel(loaded, config)
            shard_model(loaded.model, tp)  # on the host: no device ever holds the whole model
            loaded.model.to(device)
        return loaded

    # with tensor parallelism the ranks load in turn: the host holds one whole copy at a time, then the shards
    loaded = load_and_cut() if tp is None else tensor_parallel.in_turn(tp, load_and_cut)
    spec = paged_kv_spec(loaded)  # the transformers backend's probe sees the cut model's shapes already
    if tp is not None and loaded.model_impl == "native":
        spec = sharded_spec(spec, tp.world_size)
    num_blocks = config.num_blocks or _num_blocks(config, loaded, spec, device, tp)
    if tp is not None:
        num_blocks = tensor_parallel.min_over_ranks(num_blocks)
    if num_blocks < 1:
        raise ValueError(f"the KV budget holds no block of {config.block_size} tokens ({spec.bytes_per_token} bytes "
                         "per token): raise --kv-cache-memory or --gpu-memory-utilization")
    kv = KVCache(spec, num_blocks, config.block_size, device)
    info = describe_device(device)
    log.info("kv_cache", device=info.device, device_name=info.name, platform=info.platform, dtype=dtype,
             num_blocks=num_blocks, block_size=config.block_size, bytes=kv.num_bytes,
             bytes_per_token=spec.bytes_per_token, capacity_tokens=num_blocks * config.block_size,
             tensor_parallel_rank=tp.rank if tp is not None else None)
    model = build_paged_model(loaded, kv, quantization=config.quantization, tp=tp)
    static = None if tp is not None else build_static_forward(
        model, max_tokens=min(config.cuda_graph_max_tokens, config.max_num_batched_tokens),
        max_model_len=loaded.max_model_len, block_size=config.block_size, graphs=config.cuda_graphs)
    return loaded, model, static


def check_tensor_parallel(loaded: LoadedModel, config: VerifierConfig) -> None:
    """What --tensor-parallel-size runs on: Llama-style layers (common.tensor_parallel.check_layers), native or
    on the transformers backend, unquantized."""
    if config.quantization != "none":
        raise ValueError(f"--tensor-parallel-size shards float weights; --quantization {config.quantization} is a "
                         "single-process CPU path")


def _num_blocks(config: VerifierConfig, loaded: LoadedModel, spec: KVCacheSpec, device: torch.device,
                tp: TensorParallel | None = None) -> int:
    if config.kv_cache_memory is not None:
        return num_blocks_for_budget(spec, config.block_size, config.kv_cache_memory)
    if device.type != "cuda":
        return num_blocks_for_budget(spec, config.block_size, CPU_KV_CACHE_MEMORY)
    runner_for = None
    if loaded.model_impl == "transformers":
        runner_for = lambda kv: build_paged_model(loaded, kv)  # noqa: E731
    elif tp is not None:
        runner_for = lambda kv: PagedCausalLM(loaded.model, kv, pack_weights=False, tp=tp)  # noqa: E731
    peak = profile_peak_memory(loaded.model, spec, config.block_size, config.max_num_batched_tokens, device,
                               runner_for)
    budget = kv_budget_from_utilization(device, config.gpu_memory_utilization, peak)
    log.info("kv_cache_sizing", gpu_memory_utilization=config.gpu_memory_utilization, peak_bytes=peak,
             budget_bytes=budget)
    return num_blocks_for_budget(spec, config.block_size, max(0, budget))


def verifier_info(engine: VerifierEngine, config: VerifierConfig) -> verifier_pb2.VerifierInfo:
    loaded = engine.loaded
    info = describe_device(engine.device)
    return verifier_pb2.VerifierInfo(
        model_id=loaded.model_id, vocab_size=loaded.vocab_size, tokenizer_fingerprint=loaded.tokenizer_fingerprint,
        max_draft_tokens=config.max_draft_tokens, block_size=config.block_size, max_model_len=loaded.max_model_len,
        protocol_version=wire.PROTOCOL_VERSION, device=info.device, device_name=info.name, platform=info.platform,
        dtype=engine.dtype,
        features=[f for f in wire.VERIFIER_FEATURES if (f != wire.FEATURE_GOODPUT or engine.goodput is not None)
                  and (f != wire.FEATURE_TREE or engine.limits.max_tree_nodes > 0)],
        model_fingerprint=loaded.model_fingerprint,
        quantization=weights_label(config.quantization, loaded.gguf_path is not None),
        max_q_support=config.max_q_support, max_tree_nodes=engine.limits.max_tree_nodes)


def weights_label(quantization: str, from_gguf: bool) -> str:
    """VerifierInfo.quantization: int4 from a GGUF file uses its Q4 blocks as they are (PagedCausalLM), which
    computes other logits than requantizing the same floats, so the two are told apart."""
    return "int4-gguf" if quantization == "int4" and from_gguf else quantization


async def serve(config: VerifierConfig, *, stop: asyncio.Event | None = None) -> None:
    """Serve until SIGINT or SIGTERM, or until `stop` is set (see serve_until_stopped)."""
    executor = compute_thread("verifier-engine")  # the model loads on the thread that steps it
    engine = await asyncio.get_running_loop().run_in_executor(executor, build_engine, config)
    metrics = VerifierMetrics()
    async_engine = AsyncEngine(engine, metrics, executor, limits=StreamLimits.from_config(config),
                               phases=config.phases, whole_batch_goodput=config.whole_batch_goodput)
    servicer = VerifierServicer(async_engine, verifier_info(engine, config))
    server = build_grpc_server(
        config.host, config.port, service_names=(SERVICE_NAME,), options=wire.SERVER_OPTIONS, security=config,
        add_servicers=lambda s: verifier_pb2_grpc.add_VerifierServicer_to_server(servicer, s))
    metrics_server = None
    if config.metrics_port:
        metrics_server = start_metrics_server(config.metrics_port, config.host, metrics.registry)
    async_engine.start()
    await server.start()
    write_port_file(config.port_file, server.port)
    info = describe_device(engine.device)
    log.info("verifier_ready", address=f"{config.host}:{server.port}", model=engine.loaded.model_id,
             vocab_size=engine.loaded.vocab_size, device=info.device, device_name=info.name, platform=info.platform,
             dtype=engine.dtype, metrics_port=config.metrics_port or None, tls=bool(config.tls_cert),
             mutual_tls=bool(config.tls_client_ca), tokens_required=bool(config.auth_token_file))

    async def stop_verifier() -> None:
        try:
            await async_engine.stop()
            close = getattr(engine.runner.model, "close", None)  # tensor parallel: stop the other ranks
            if close is not None:
                await asyncio.to_thread(close)
        finally:
            if metrics_server is not None:
                await asyncio.to_thread(metrics_server.close)

    async def drain() -> None:
        # readiness goes first: a router or probe stops sending new work here while the running sequences finish
        await server.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)
        if await async_engine.drain(config.drain_grace_s):
            async_engine.end_streams("the verifier is shutting down and its drain grace (--drain-grace) is over: "
                                     "resume the sequence on another verifier")

    await serve_until_stopped(server, on_stop=stop_verifier, stop=stop, drain=drain)
