"""The verifier's configuration: one frozen dataclass. Each field is also a CLI flag of `specwire verifier`
(common.config.option) with an environment twin SPECWIRE_*."""

from __future__ import annotations

from dataclasses import dataclass

from common.config import DTYPES, format_bytes, option, parse_bytes


@dataclass(frozen=True)
class VerifierConfig:
    model: str = option(None, "target: HF model directory or .gguf file")
    host: str = option("127.0.0.1", "address to bind")
    port: int = option(50051, "gRPC port")
    dtype: str = option("float32", "weights and KV cache dtype", choices=DTYPES)
    max_draft_tokens: int = option(16, "largest draft block accepted")
    block_size: int = option(16, "tokens per KV block")
    kv_cache_memory: int = option(1 << 30, "bytes for the KV pool, used unless --num-blocks is given "
                                  "(units: K, M, G, GiB...)", parse=parse_bytes, show=format_bytes)
    num_blocks: int | None = option(None, "KV blocks (overrides --kv-cache-memory)", parse=int)
    max_num_batched_tokens: int = option(2048, "token budget of one step")
    metrics_port: int = option(0, "Prometheus /metrics port (0: off)")
    log_level: str = option("INFO", "log level")

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("--model (or SPECWIRE_MODEL) is required: the target's HF directory or .gguf file")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if not 0 <= self.port < 65536 or not 0 <= self.metrics_port < 65536:
            raise ValueError("ports must be in [0, 65535]")
        if self.max_draft_tokens < 0:
            raise ValueError(f"max_draft_tokens must be >= 0, got {self.max_draft_tokens}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.kv_cache_memory < 1:
            raise ValueError(f"kv_cache_memory must be positive, got {self.kv_cache_memory}")
        if self.max_num_batched_tokens < self.max_draft_tokens + 1:
            raise ValueError("max_num_batched_tokens must hold at least one full verification block "
                             f"({self.max_draft_tokens + 1} tokens)")
