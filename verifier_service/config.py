"""The verifier's configuration: one frozen dataclass. Each field is also a CLI flag of `specwire verifier`
(common.config.option) with an environment twin SPECWIRE_*."""

from __future__ import annotations

from dataclasses import dataclass

from common.config import (
    DEVICE_CHOICES_HELP,
    DTYPES,
    MODEL_IMPL_HELP,
    MODEL_IMPLS,
    QUANTIZATION_HELP,
    QUANTIZATIONS,
    CpuThreadsConfig,
    ServerSecurityConfig,
    StaticForwardConfig,
    check_weights,
    format_bytes,
    option,
    parse_bytes,
)

CPU_KV_CACHE_MEMORY = 1 << 30  # the pool's default size on CPU, where the host's memory is shared


@dataclass(frozen=True)
class VerifierConfig(ServerSecurityConfig, StaticForwardConfig, CpuThreadsConfig):
    model: str = option(None, "target: HF model directory or .gguf file")
    host: str = option("127.0.0.1", "address to bind")
    port: int = option(50051, "gRPC port (0: one the OS chooses; see --port-file)")
    port_file: str | None = option(None, "once the gRPC port is bound, write its number to this file (how a launcher "
                                   "learns the port --port 0 chose)", parse=str)
    device: str = option("auto", DEVICE_CHOICES_HELP)
    dtype: str = option("auto", "weights and KV cache dtype (auto: bfloat16 on a GPU, float32 on CPU)",
                        choices=("auto", *DTYPES))
    quantization: str = option("none", QUANTIZATION_HELP, choices=QUANTIZATIONS)
    model_impl: str = option("auto", MODEL_IMPL_HELP, choices=MODEL_IMPLS)
    tensor_parallel_size: int = option(1, "ranks the target is split over (Megatron-style: attention heads and the "
                                       "MLP by columns and rows, the KV pool by heads), one process each on this "
                                       "host: GPU r for rank r with --device cuda (NCCL, or RCCL on ROCm), gloo on "
                                       "CPU; models with Llama-style layers (native, or on the transformers "
                                       "backend), unquantized")
    max_draft_tokens: int = option(16, "largest draft block accepted (a token tree's depth)")
    max_tree_nodes: int = option(64, "draft tokens one token-tree proposal may hold (at most 64, and below the "
                                 "step's token budget); 0: chains only")
    block_size: int = option(16, "tokens per KV block")
    gpu_memory_utilization: float = option(0.9, "on a GPU, the fraction of its memory this verifier may use: the KV "
                                           "pool gets what weights and the largest step's activations leave")
    kv_cache_memory: int | None = option(None, "bytes for the KV pool (units: K, M, G, GiB...); default: "
                                         "--gpu-memory-utilization on a GPU, 1GiB on CPU", parse=parse_bytes,
                                         show=format_bytes)
    num_blocks: int | None = option(None, "KV blocks (overrides --kv-cache-memory)", parse=int)
    max_num_batched_tokens: int = option(2048, "token budget of one step")
    sequence_idle_timeout_s: float = option(120.0, "end a sequence (DEADLINE_EXCEEDED) that has waited this long "
                                            "for a proposal, freeing its KV blocks (0: never)",
                                            flag="--sequence-idle-timeout")
    max_sequences_per_stream: int = option(4096, "open sequences one Verify stream (one draft process) may hold; "
                                           "more are refused with RESOURCE_EXHAUSTED, so no draft can grow the "
                                           "verifier's memory without bound")
    # Global limits: what all drafts together may hold, so that no client grows the verifier without bound.
    max_streams: int = option(256, "Verify streams (draft processes) served at once; a hello past it is refused "
                              "with RESOURCE_EXHAUSTED")
    max_sequences: int = option(16384, "open sequences over all streams; an open past it is refused with "
                                "RESOURCE_EXHAUSTED")
    max_waiting_tokens: int = option(1 << 20, "tokens of the sequences waiting for KV blocks (opened or preempted), "
                                     "over all streams; a new sequence that would wait past it is refused with "
                                     "RESOURCE_EXHAUSTED (one admitted at once, or a resume, never is)")
    max_q_support: int = option(256, "tokens one draft distribution (a sparse-q position) may list; more is refused "
                                "with RESOURCE_EXHAUSTED before it reaches the engine. Advertised in GetInfo "
                                "(VerifierInfo.max_q_support): a draft samples from at most this many")
    max_pending_commands: int = option(4096, "messages of one stream read but not yet applied by the engine; past "
                                       "it the stream is not read until the engine catches up (backpressure)")
    max_pending_tokens: int = option(1 << 20, "token ids those messages of one stream hold (prompt tokens, draft and "
                                     "assumed tokens, draft-distribution entries); past it the stream is not read "
                                     "until the engine catches up (backpressure)")
    max_stream_backlog: int = option(65536, "replies waiting to be sent on one stream (its draft not reading); past "
                                     "it the stream is ended with RESOURCE_EXHAUSTED")
    max_protocol_errors: int = option(64, "protocol errors in a row (malformed, unknown or duplicate messages, with "
                                      "no verdict between) after which a stream is ended with RESOURCE_EXHAUSTED")
    drain_grace_s: float = option(10.0, "on SIGTERM (or SIGINT): admit no new sequence (an open gets UNAVAILABLE, and "
                                  "a draft with other verifiers opens it there), go on verifying the running ones "
                                  "for at most this many seconds, then end the streams so that what is left "
                                  "resumes elsewhere", flag="--drain-grace")
    handshake_timeout_s: float = option(10.0, "end a Verify stream (DEADLINE_EXCEEDED) whose hello has not arrived "
                                        "within this many seconds", flag="--handshake-timeout")
    speculation_trial: bool = option(True, "with --goodput, put the goodput choice on trial against plain decoding "
                                     "on the tokens per second the verifier measures, and follow the one that "
                                     "measures more (see verifier_service/speculation_trial.py)")
    goodput: bool = option(True, "choose each sequence's next draft length from the batch's load and acceptance "
                           "(maximising verified tokens per second) and send it with its verdict, for drafts that "
                           "ask (--speculation auto); false: drafts decide alone")
    goodput_plain_margin: float = option(0.08, "with --goodput, what drafting must gain over plain decoding "
                                         "before it is chosen, in expected tokens a plain step per sequence it "
                                         "drafts for (its unpriced costs; at most 0.03, the choice's own "
                                         "tolerance, it changes nothing; see docs/load.md)")
    goodput_switch_tolerance: float = option(0.12, "with --goodput, where every draft process's last choice drafted "
                                             "nothing, or most of the step's sequences decode plainly now, the share by which drafting's predicted goodput must beat "
                                             "plain decoding's before it is chosen again (hysteresis; elsewhere "
                                             "--goodput-plain-margin holds, and below it, it holds here too; "
                                             "see docs/load.md)")
    goodput_defer_tolerance: float = option(0.2, "with --goodput, where the switch tolerance holds and the choice "
                                            "would have a draft process defer some of its sequences (their "
                                            "untaken context more than its batch feeds in one round), the share "
                                            "by which drafting's predicted goodput must beat plain decoding's "
                                            "(at or below --goodput-switch-tolerance or --goodput-plain-margin, "
                                            "those hold; see docs/load.md)")
    whole_batch_goodput: bool = option(False, "with --goodput and --phases hold, choose draft lengths for the "
                                       "whole batch the phase plan waits for, not only the sequences a step "
                                       "answered (see docs/load.md: it helped no measured load on the default "
                                       "pair and cut 8 streams on two pinned cores at 20 ms RTT by a fifth)")
    phases: str = option("hold", "when steps start (phases.py): hold: a step waits for the sequences answered with "
                         "it while that costs less than the step it saves; split: also verify half of them per step "
                         "when drafting one half while the other is verified is faster (for drafts on other hosts: "
                         "on one host their overlap slows both); off: step as soon as work is in",
                         choices=("hold", "split", "off"))
    metrics_port: int = option(0, "Prometheus /metrics port (0: off)")
    log_level: str = option("INFO", "log level")

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("--model (or SPECWIRE_MODEL) is required: the target's HF directory or .gguf file")
        self.check_security()
        self.check_static_forward()
        self.check_cpu_threads()
        check_weights(self.dtype, self.quantization, self.model_impl)
        if not 0 <= self.port < 65536 or not 0 <= self.metrics_port < 65536:
            raise ValueError("ports must be in [0, 65535]")
        if self.max_draft_tokens < 0:
            raise ValueError(f"max_draft_tokens must be >= 0, got {self.max_draft_tokens}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_memory is not None and self.kv_cache_memory < 1:
            raise ValueError(f"kv_cache_memory must be positive, got {self.kv_cache_memory}")
        if self.max_sequences_per_stream < 1:
            raise ValueError(f"max_sequences_per_stream must be >= 1, got {self.max_sequences_per_stream}")
        for name in ("max_streams", "max_sequences", "max_waiting_tokens", "max_q_support", "max_pending_commands",
                     "max_pending_tokens", "max_stream_backlog", "max_protocol_errors"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.handshake_timeout_s > 0:
            raise ValueError(f"handshake_timeout_s must be > 0, got {self.handshake_timeout_s}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        for name in ("goodput_plain_margin", "goodput_switch_tolerance", "goodput_defer_tolerance"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if self.drain_grace_s < 0:
            raise ValueError(f"drain_grace_s must be >= 0, got {self.drain_grace_s}")
        if self.sequence_idle_timeout_s < 0:
            raise ValueError(f"sequence_idle_timeout_s must be >= 0, got {self.sequence_idle_timeout_s}")
        if not 0 <= self.max_tree_nodes <= 64:
            raise ValueError(f"max_tree_nodes must be in [0, 64] (a node's ancestors are a 64-bit mask), got "
                             f"{self.max_tree_nodes}")
        if self.max_num_batched_tokens < self.max_draft_tokens + 1:
            raise ValueError("max_num_batched_tokens must hold at least one full verification block "
                             f"({self.max_draft_tokens + 1} tokens)")
