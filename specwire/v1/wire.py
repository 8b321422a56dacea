"""The one translation layer of the wire: protobuf messages <-> the dataclasses the services and the SDK use,
the protocol version, the handshake rule and the gRPC channel and server options.

Both services and the SDK import it. It imports only the stubs beside it and torch-free modules of `common`,
so a client still installs and imports without torch (tests/test_packaging.py checks both).
"""

from __future__ import annotations

import dataclasses

from common.errors import ErrorCode, invalid_argument
from common.generation_stats import GenerationStats
from common.sampling import FinishReason, SamplingParams, SparseProbs, WireMode
from specwire.v1 import common_pb2, draft_pb2, verifier_pb2

PROTOCOL_VERSION = "1"
# Optional features a verifier lists in VerifierInfo.features; a draft asks for one only if it is listed.
FEATURE_COUPLED = "coupled"  # OpenSequence.coupled
FEATURE_CACHE_SALT = "cache_salt"  # OpenSequence.cache_salt
FEATURE_GOODPUT = "goodput"  # Proposal.max_draft_tokens -> Verdict.next_draft_tokens
FEATURE_TREE = "tree"  # Proposal.draft_parents (VerifierInfo.max_tree_nodes)
FEATURE_LOAD = "load"  # VerifierMessage.load: load reports and drain notices
VERIFIER_FEATURES = (FEATURE_COUPLED, FEATURE_CACHE_SALT, FEATURE_GOODPUT, FEATURE_TREE, FEATURE_LOAD)
# vLLM's limit is none; ours bounds what one open message makes the verifier hash and log.
MAX_CACHE_SALT_CHARS = 256

# NOTE: one Proposal carries at most max_draft_tokens sparse distributions of q_max_support entries: 16 x 64
# entries are about 10 KB. 64 MiB leaves room for long prompts (a 1M-token prompt is 5 MB of varints).
MAX_MESSAGE_BYTES = 64 << 20
_MESSAGE_LIMITS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
]
# NOTE: keepalive both ways. The servers ping every 30 s and drop a peer that has not answered within 10 s, so
# a dead draft's stream (and its sequences) goes away; they accept the drafts' own 30 s pings even on an idle
# stream (gRPC's default policy would answer such pings with GOAWAY after two).
SERVER_OPTIONS: list[tuple[str, int]] = [
    *_MESSAGE_LIMITS,
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.http2.max_ping_strikes", 0),
    # a second server on a port in use fails to bind instead of silently sharing its connections (Linux's
    # SO_REUSEPORT, which gRPC sets by default, splits the connections between both)
    ("grpc.so_reuseport", 0),
]
# The draft service's server: a client connection is asked to reconnect (GOAWAY) after 5 minutes, its calls in
# flight going on for up to an hour, so that a client spreading calls over a dns:/// name (the gateway over a
# headless Service) resolves it again and finds draft services added since (gRPC re-resolves on a GOAWAY).
DRAFT_SERVER_OPTIONS: list[tuple[str, int]] = [
    *SERVER_OPTIONS,
    ("grpc.max_connection_age_ms", 300_000),
    ("grpc.max_connection_age_grace_ms", 3_600_000),
]

CHANNEL_OPTIONS: list[tuple[str, int]] = [
    *_MESSAGE_LIMITS,
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.max_pings_without_data", 0),
]

# -- finish reasons --------------------------------------------------------------------------------------------

_FINISH_TO_PROTO: dict[FinishReason | None, int] = {
    None: common_pb2.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.CANCELLED: common_pb2.FINISH_REASON_CANCELLED,
}
_FINISH_FROM_PROTO = {v: k for k, v in _FINISH_TO_PROTO.items()}


def finish_to_proto(reason: FinishReason | None) -> int:
    return _FINISH_TO_PROTO[reason]


def finish_from_proto(value: int) -> FinishReason | None:
    """An unknown value (a newer peer) reads as no reason rather than failing the stream."""
    return _FINISH_FROM_PROTO.get(value)


# -- wire modes ------------------------------------------------------------------------------------------------

_WIRE_MODE_TO_PROTO: dict[WireMode | None, int] = {
    None: common_pb2.WIRE_MODE_UNSPECIFIED,
    WireMode.SPARSE: common_pb2.WIRE_MODE_SPARSE,
    WireMode.ONE_HOT: common_pb2.WIRE_MODE_ONE_HOT,
    WireMode.COUPLED: common_pb2.WIRE_MODE_COUPLED,
}
_WIRE_MODE_FROM_PROTO = {v: k for k, v in _WIRE_MODE_TO_PROTO.items()}


def wire_mode_to_proto(mode: WireMode | None) -> int:
    return _WIRE_MODE_TO_PROTO[mode]


def wire_mode_from_proto(value: int) -> WireMode | None:
    """None: the service's default. An unknown value is INVALID_ARGUMENT: a silent fallback would change what a
    seeded request outputs."""
    if value not in _WIRE_MODE_FROM_PROTO:
        raise invalid_argument(f"unknown wire_mode {value}; this service knows "
                               f"{', '.join(m.value for m in WireMode)} (or unset for its default)")
    return _WIRE_MODE_FROM_PROTO[value]


# -- sampling parameters ---------------------------------------------------------------------------------------

DEFAULT_MAX_TOKENS = SamplingParams.max_tokens


def sampling_message(*, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
                     max_tokens: int = DEFAULT_MAX_TOKENS, ignore_eos: bool = False) -> common_pb2.SamplingParams:
    """The message for raw values, unvalidated: the SDK sends what the caller gave and the service judges it."""
    msg = common_pb2.SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=max_tokens,
                                    ignore_eos=ignore_eos)
    if seed is not None:
        msg.seed = seed
    return msg


def sampling_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    return sampling_message(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                            seed=params.seed, max_tokens=params.max_tokens, ignore_eos=params.ignore_eos)


def sampling_from_proto(msg: common_pb2.SamplingParams, wire_mode: WireMode | None = None) -> SamplingParams:
    """Unset fields take SamplingParams' defaults. Raises ServiceError (INVALID_ARGUMENT) with a readable message
    for out-of-range values, max_tokens 0 included: it is a value, not "unset". The wire mode travels beside the
    message (GenerateRequest.wire_mode, OpenSequence.coupled): its reader passes it in."""
    return SamplingParams(
        temperature=msg.temperature if msg.HasField("temperature") else 1.0,
        top_k=msg.top_k,
        top_p=msg.top_p if msg.HasField("top_p") else 1.0,
        seed=msg.seed if msg.HasField("seed") else None,
        max_tokens=msg.max_tokens if msg.HasField("max_tokens") else DEFAULT_MAX_TOKENS,
        ignore_eos=msg.ignore_eos,
        wire_mode=wire_mode,
    )


# -- a generation's statistics ---------------------------------------------------------------------------------

# GenerationStats' fields are draft.proto's Stats fields by name; the finish reason is the one converted.
_STATS_FIELDS = tuple(f.name for f in dataclasses.fields(GenerationStats) if f.name != "finish_reason")


def stats_to_proto(stats: GenerationStats) -> draft_pb2.Stats:
    return draft_pb2.Stats(finish_reason=finish_to_proto(stats.finish_reason),
                           **{name: getattr(stats, name) for name in _STATS_FIELDS})


def stats_from_proto(msg: draft_pb2.Stats) -> GenerationStats:
    values = {name: getattr(msg, name) for name in _STATS_FIELDS}
    values["accepted_per_position"] = list(msg.accepted_per_position)
    values["drafted_per_position"] = list(msg.drafted_per_position)
    return GenerationStats(finish_reason=finish_from_proto(msg.finish_reason), **values)


# -- prefix-cache salt -----------------------------------------------------------------------------------------

def check_cache_salt(salt: str | None) -> str | None:
    """The salt as given, or INVALID_ARGUMENT: it must be 1 to MAX_CACHE_SALT_CHARS characters (an empty salt
    is refused, as vLLM does, rather than read as "no salt": a tenant that meant to isolate itself would not)."""
    if salt is not None and not 1 <= len(salt) <= MAX_CACHE_SALT_CHARS:
        raise invalid_argument(f"cache_salt must be 1 to {MAX_CACHE_SALT_CHARS} characters, got {len(salt)}")
    return salt


def cache_salt_from_proto(msg) -> str | None:
    """A GenerateRequest's or OpenSequence's cache_salt (None when unset), checked."""
    return check_cache_salt(msg.cache_salt if msg.HasField("cache_salt") else None)


# -- draft distributions ---------------------------------------------------------------------------------------

def draft_probs_to_proto(draft_probs: tuple[SparseProbs, ...]) -> list[verifier_pb2.SparseDistribution]:
    return [verifier_pb2.SparseDistribution(token_ids=q.token_ids, probs=q.probs) for q in draft_probs]


def draft_probs_from_proto(msgs) -> tuple[SparseProbs, ...] | None:
    """None when the proposal carries no distributions: its drafts are one-hot (or greedy)."""
    return tuple(SparseProbs(tuple(d.token_ids), tuple(d.probs)) for d in msgs) or None


# -- errors on the Verify stream -------------------------------------------------------------------------------

_ERROR_CODES = {c.value: c for c in ErrorCode}


def error_code_from_proto(value: int) -> ErrorCode:
    return _ERROR_CODES.get(value, ErrorCode.INTERNAL)


def error_code_from_status_name(name: str) -> ErrorCode:
    """grpc.StatusCode.X.name -> ErrorCode.X; a status the services never send reads as UNAVAILABLE."""
    return ErrorCode[name] if name in ErrorCode.__members__ else ErrorCode.UNAVAILABLE


# -- the handshake ---------------------------------------------------------------------------------------------

def handshake_mismatch(info: verifier_pb2.VerifierInfo, hello: verifier_pb2.Hello) -> str | None:
    """Why this draft cannot work with this verifier, or None. Both sides apply this one rule: the verifier to
    a Hello (answering FAILED_PRECONDITION), the draft to GetInfo before it opens a stream."""
    if hello.protocol_version and info.protocol_version and hello.protocol_version != info.protocol_version:
        return (f"protocol version {hello.protocol_version!r} is not supported; this verifier speaks "
                f"{info.protocol_version!r}")
    if hello.tokenizer_fingerprint != info.tokenizer_fingerprint:
        return (f"tokenizer mismatch with the verifier's target {info.model_id!r}: fingerprints "
                f"{hello.tokenizer_fingerprint[:12]}… (draft) and {info.tokenizer_fingerprint[:12]}… (target); "
                "draft and target must share one tokenizer")
    if hello.vocab_size != info.vocab_size:
        return (f"vocabulary mismatch: the draft has {hello.vocab_size} logits rows, the target "
                f"{info.model_id!r} {info.vocab_size}")
    return None
