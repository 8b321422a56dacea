"""The verifier's configuration: one frozen dataclass, filled from CLI flags or SPECWIRE_* variables."""

from __future__ import annotations

from dataclasses import dataclass

from common.config import DTYPES


@dataclass(frozen=True)
class VerifierConfig:
    model: str
    host: str = "127.0.0.1"
    port: int = 50051
    dtype: str = "float32"
    max_draft_tokens: int = 16
    block_size: int = 16
    kv_cache_memory: int = 1 << 30  # bytes for the KV pool, used unless num_blocks is set
    num_blocks: int | None = None
    max_num_batched_tokens: int = 2048
    metrics_port: int = 0  # 0: no Prometheus endpoint
    log_level: str = "INFO"

    def __post_init__(self) -> None:
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
