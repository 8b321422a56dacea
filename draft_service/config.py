"""The draft service's configuration: one frozen dataclass, filled from CLI flags or SPECWIRE_* variables."""

from __future__ import annotations

from dataclasses import dataclass

from common.config import DTYPES

WIRE_MODES = ("sparse", "one-hot")
PROPOSERS = ("model", "ngram")


@dataclass(frozen=True)
class DraftConfig:
    model: str
    verifier: str  # HOST:PORT
    host: str = "127.0.0.1"
    port: int = 50052
    dtype: str = "float32"
    num_speculative_tokens: int = 4  # k, or the largest k when adaptive
    proposer: str = "model"  # "model": the draft model; "ngram": prompt lookup, no model weights used
    adaptive_k: bool = False  # choose k per sequence and round from its acceptance and the measured timings
    draft_confidence_threshold: float = 0.0  # stop a block early when the draft's top probability falls below
    wire_mode: str = "sparse"  # how sampled drafts send q: "sparse" (top-q_max_support of q) or "one-hot"
    q_max_support: int = 64
    block_size: int = 16
    kv_cache_memory: int = 512 << 20
    connect_timeout_s: float = 60.0
    metrics_port: int = 0  # 0: no Prometheus endpoint
    log_level: str = "INFO"

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {self.num_speculative_tokens}")
        if self.wire_mode not in WIRE_MODES:
            raise ValueError(f"wire_mode must be one of {', '.join(WIRE_MODES)}, got {self.wire_mode!r}")
        if self.proposer not in PROPOSERS:
            raise ValueError(f"proposer must be one of {', '.join(PROPOSERS)}, got {self.proposer!r}")
        if not 0.0 <= self.draft_confidence_threshold < 1.0:
            raise ValueError(f"draft_confidence_threshold must be in [0, 1), got {self.draft_confidence_threshold}")
        if self.q_max_support < 1:
            raise ValueError(f"q_max_support must be >= 1, got {self.q_max_support}")
        if ":" not in self.verifier:
            raise ValueError(f"verifier must be HOST:PORT, got {self.verifier!r}")
        if not 0 <= self.port < 65536 or not 0 <= self.metrics_port < 65536:
            raise ValueError("ports must be in [0, 65535]")
