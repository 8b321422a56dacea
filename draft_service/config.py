"""The draft service's configuration: one frozen dataclass. Each field is also a CLI flag of `specwire draft`
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
from common.sampling import WireMode
from draft_service.placement import VerifierTargets

WIRE_MODES = tuple(m.value for m in WireMode)
PROPOSERS = ("model", "ngram")
SPECULATION_MODES = ("auto", "adaptive", "fixed")
# an opening's waits for its burst (Generator._alone), at most this many --opening-wait-ms in all from the start
# of the first of its burst to wait: a steady stream of arrivals must not hold a request's prompt back for long
SETTLE_WAITS = 5


@dataclass(frozen=True)
class DraftConfig(ServerSecurityConfig, StaticForwardConfig, CpuThreadsConfig):
    model: str = option(None, "draft: HF model directory or .gguf file (with --proposer ngram: the tokenizer)")
    verifier: str = option("127.0.0.1:50051", "verifier HOST:PORT; several, comma-separated, or dns:///NAME:PORT (a name "
                           "resolving to every verifier, followed as it changes): new sequences are placed by "
                           "cached prefix and load, and move to another verifier when theirs goes")
    host: str = option("127.0.0.1", "address to bind")
    port: int = option(50052, "gRPC port (0: one the OS chooses; see --port-file)")
    port_file: str | None = option(None, "once the gRPC port is bound, write its number to this file (how a launcher "
                                   "learns the port --port 0 chose)", parse=str)
    device: str = option("auto", DEVICE_CHOICES_HELP)
    dtype: str = option("auto", "weights and KV cache dtype (auto: bfloat16 on a GPU, float32 on CPU)",
                        choices=("auto", *DTYPES))
    quantization: str = option("none", QUANTIZATION_HELP, choices=QUANTIZATIONS)
    model_impl: str = option("auto", MODEL_IMPL_HELP, choices=MODEL_IMPLS)
    num_speculative_tokens: int = option(4, "draft tokens per round (k): every round with --speculation fixed, "
                                         "the most otherwise (0: target only)")
    speculation: str = option("auto", "how many tokens each round drafts: auto (the verifier chooses from its load "
                              "and the sequence's acceptance, capped by k and by what this service's own drafting "
                              "costs; 0 under heavy load), adaptive (this sequence's own tokens/s alone, no "
                              "verifier choice) or fixed (k every round). Seeded requests verified by rejection "
                              "sampling (sparse, one-hot) always draft k", choices=SPECULATION_MODES)
    allow_request_fixed: bool = option(False, "honour a request's speculation FIXED (its k every round, whatever "
                                       "the verifier chooses): for comparing the modes on one set of processes; a "
                                       "client could otherwise draft under load the verifier would run plain, "
                                       "slowing every sequence of its steps")
    proposer: str = option("model", "model: the draft model; ngram: prompt lookup, no model weights used",
                           choices=PROPOSERS)
    pipeline: bool = option(False, "pipelined drafting: while a verdict is in flight, draft the next block "
                            "assuming the current one is fully accepted (and guessing the bonus token) and send it "
                            "at once; hides the round trip when the verifier is on another host")
    pipeline_width: int = option(0, "with --pipeline: branches drafted ahead per round, fixed (1: only the "
                                 "full-acceptance guess; at most 8); 0: learned from the measured stall and from "
                                 "which branches the verdicts adopt")
    adaptive_k: bool = option(False, "the same as --speculation adaptive (kept for older command lines)")
    draft_confidence_threshold: float = option(0.0, "end a draft block early when the draft's top probability "
                                               "falls below this")
    tree_branches: int = option(1, "token trees: children per node of a round's draft tree, grown best first "
                                "over the draft's path probability to a depth of --num-speculative-tokens "
                                "(1: a chain of k, as without trees); needs a verifier with the tree feature")
    tree_nodes: int = option(16, "token trees: draft tokens one tree holds at most (what the verifier verifies in a "
                             "round; at most the verifier's max_tree_nodes)")
    tree_calibration: bool = option(True, "token trees, greedy and coupled: rank nodes by the acceptance the "
                                    "verdicts showed for the draft's probabilities (per sibling rank and band), not "
                                    "by the raw probabilities; one-hot and sparse trees always use the raw ones")
    wire_mode: str = option("sparse", "how sampled requests are verified (a request may choose its own): sparse "
                            "(rejection sampling; q sent on its top --q-max-support tokens), one-hot (rejection "
                            "sampling; ids only) or coupled (Gumbel-max coupling; ids only; a seeded output is the "
                            "target-alone output whatever the draft, k or pipelining)", choices=WIRE_MODES)
    q_max_support: int = option(64, "tokens of q kept: sent in sparse mode, the candidates of a coupled draft")
    block_size: int = option(16, "tokens per KV block")
    kv_cache_memory: int = option(512 << 20, "bytes for the draft's KV pool", parse=parse_bytes, show=format_bytes)
    max_num_batched_tokens: int = option(2048, "most tokens in one draft forward: a longer prompt is fed to the "
                                         "draft in chunks of this size, one chunk per drafting batch, so the other "
                                         "sequences draft between its chunks")
    max_prompt_bytes: int = option(16 << 20, "largest prompt text accepted, in UTF-8 bytes (INVALID_ARGUMENT "
                                   "above it); bounds how long one prompt's tokenization takes", parse=parse_bytes,
                                   show=format_bytes)
    connect_timeout_s: float = option(60.0, "seconds to wait for the verifier at start", flag="--connect-timeout")
    opening_wait_ms: float = option(10.0, "under --speculation auto, how long a new request waits for no other to "
                                    "arrive before it counts the requests on this service and opens: alone, its "
                                    "prompt is proposed at once and its next block drafted beside it; with others "
                                    "it drafts first the length the verifier chose at that load, and proposes with "
                                    f"its burst. An arrival starts the wait again, up to {SETTLE_WAITS} waits from "
                                    "the start of the burst's first wait; 0: no wait")
    drain_grace_s: float = option(10.0, "on SIGTERM (or SIGINT): take no new request (clients are told to go to "
                                  "another draft service) and let the generations in progress finish for at most "
                                  "this many seconds, then cancel them", flag="--drain-grace")
    verifier_retry_deadline_s: float = option(30.0, "when the verifier connection breaks, how long a sequence "
                                              "waits for it to come back and resume before it ends with "
                                              "UNAVAILABLE", flag="--verifier-retry-deadline")
    verifier_tls: bool = option(False, "connect to the verifier with TLS (implied by --verifier-tls-ca); without "
                                "a CA, the system's trust store checks its certificate")
    verifier_tls_ca: str | None = option(None, "PEM CA bundle that signed the verifier's certificate", parse=str)
    verifier_tls_cert: str | None = option(None, "PEM client certificate for a verifier that requires mutual TLS",
                                           parse=str)
    verifier_tls_key: str | None = option(None, "PEM private key of --verifier-tls-cert", parse=str)
    verifier_tls_server_name: str | None = option(None, "check the verifier's certificate against this name "
                                                  "instead of the host of --verifier", parse=str)
    verifier_token_file: str | None = option(None, "file whose first token is sent to the verifier as a bearer "
                                             "token", parse=str)
    metrics_port: int = option(0, "Prometheus /metrics port (0: off)")
    log_level: str = option("INFO", "log level")

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("--model (or SPECWIRE_MODEL) is required: the draft's HF directory or .gguf file")
        self.check_security()
        if bool(self.verifier_tls_cert) != bool(self.verifier_tls_key):
            raise ValueError("a client certificate for the verifier needs both --verifier-tls-cert and "
                             "--verifier-tls-key")
        if self.verifier_retry_deadline_s < 0:
            raise ValueError(f"verifier_retry_deadline_s must be >= 0, got {self.verifier_retry_deadline_s}")
        check_weights(self.dtype, self.quantization, self.model_impl)
        self.check_static_forward()
        self.check_cpu_threads()
        if not 0 <= self.pipeline_width <= 8:
            raise ValueError(f"pipeline_width must be in [0, 8] (0: learned), got {self.pipeline_width}")
        if not 1 <= self.tree_branches <= 16:
            raise ValueError(f"tree_branches must be in [1, 16] (1: chains), got {self.tree_branches}")
        if not 1 <= self.tree_nodes <= 64:
            raise ValueError(f"tree_nodes must be in [1, 64], got {self.tree_nodes}")
        if self.tree_branches > 1 and self.proposer != "model":
            raise ValueError("token trees (--tree-branches above 1) are grown by the draft model; prompt lookup "
                             "(--proposer ngram) proposes chains")
        if self.num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {self.num_speculative_tokens}")
        if self.wire_mode not in WIRE_MODES:
            raise ValueError(f"wire_mode must be one of {', '.join(WIRE_MODES)}, got {self.wire_mode!r}")
        if self.speculation not in SPECULATION_MODES:
            raise ValueError(f"speculation must be one of {', '.join(SPECULATION_MODES)}, got {self.speculation!r}")
        if self.adaptive_k and self.speculation not in ("auto", "adaptive"):
            raise ValueError(f"--adaptive-k is --speculation adaptive; it contradicts --speculation {self.speculation}")
        if self.proposer not in PROPOSERS:
            raise ValueError(f"proposer must be one of {', '.join(PROPOSERS)}, got {self.proposer!r}")
        if not 0.0 <= self.draft_confidence_threshold < 1.0:
            raise ValueError(f"draft_confidence_threshold must be in [0, 1), got {self.draft_confidence_threshold}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_prompt_bytes < 1:
            raise ValueError(f"max_prompt_bytes must be >= 1, got {self.max_prompt_bytes}")
        if self.q_max_support < 1:
            raise ValueError(f"q_max_support must be >= 1, got {self.q_max_support}")
        if self.drain_grace_s < 0:
            raise ValueError(f"drain_grace_s must be >= 0, got {self.drain_grace_s}")
        if not 0 <= self.opening_wait_ms <= 1000:
            raise ValueError(f"opening_wait_ms must be in [0, 1000], got {self.opening_wait_ms}")
        VerifierTargets.parse(self.verifier)  # raises ValueError naming the forms it takes
        if not 0 <= self.port < 65536 or not 0 <= self.metrics_port < 65536:
            raise ValueError("ports must be in [0, 65535]")

    @property
    def speculation_mode(self) -> str:
        """--speculation, with the older --adaptive-k meaning adaptive."""
        return "adaptive" if self.adaptive_k else self.speculation

    @property
    def verifier_uses_tls(self) -> bool:
        return self.verifier_tls or bool(self.verifier_tls_ca or self.verifier_tls_cert)
