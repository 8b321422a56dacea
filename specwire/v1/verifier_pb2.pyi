from specwire.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class VerifierInfo(_message.Message):
    __slots__ = ("model_id", "vocab_size", "tokenizer_fingerprint", "max_draft_tokens", "block_size", "max_model_len", "protocol_version", "device", "device_name", "platform", "dtype", "features", "model_fingerprint", "quantization", "max_q_support", "max_tree_nodes")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    MAX_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_NAME_FIELD_NUMBER: _ClassVar[int]
    PLATFORM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    MAX_Q_SUPPORT_FIELD_NUMBER: _ClassVar[int]
    MAX_TREE_NODES_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    vocab_size: int
    tokenizer_fingerprint: str
    max_draft_tokens: int
    block_size: int
    max_model_len: int
    protocol_version: str
    device: str
    device_name: str
    platform: str
    dtype: str
    features: _containers.RepeatedScalarFieldContainer[str]
    model_fingerprint: str
    quantization: str
    max_q_support: int
    max_tree_nodes: int
    def __init__(self, model_id: _Optional[str] = ..., vocab_size: _Optional[int] = ..., tokenizer_fingerprint: _Optional[str] = ..., max_draft_tokens: _Optional[int] = ..., block_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., protocol_version: _Optional[str] = ..., device: _Optional[str] = ..., device_name: _Optional[str] = ..., platform: _Optional[str] = ..., dtype: _Optional[str] = ..., features: _Optional[_Iterable[str]] = ..., model_fingerprint: _Optional[str] = ..., quantization: _Optional[str] = ..., max_q_support: _Optional[int] = ..., max_tree_nodes: _Optional[int] = ...) -> None: ...

class DraftMessage(_message.Message):
    __slots__ = ("hello", "open", "propose", "close")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    OPEN_FIELD_NUMBER: _ClassVar[int]
    PROPOSE_FIELD_NUMBER: _ClassVar[int]
    CLOSE_FIELD_NUMBER: _ClassVar[int]
    hello: Hello
    open: OpenSequence
    propose: Proposal
    close: CloseSequence
    def __init__(self, hello: _Optional[_Union[Hello, _Mapping]] = ..., open: _Optional[_Union[OpenSequence, _Mapping]] = ..., propose: _Optional[_Union[Proposal, _Mapping]] = ..., close: _Optional[_Union[CloseSequence, _Mapping]] = ...) -> None: ...

class Hello(_message.Message):
    __slots__ = ("draft_model_id", "vocab_size", "tokenizer_fingerprint", "protocol_version", "load_reports")
    DRAFT_MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    LOAD_REPORTS_FIELD_NUMBER: _ClassVar[int]
    draft_model_id: str
    vocab_size: int
    tokenizer_fingerprint: str
    protocol_version: str
    load_reports: bool
    def __init__(self, draft_model_id: _Optional[str] = ..., vocab_size: _Optional[int] = ..., tokenizer_fingerprint: _Optional[str] = ..., protocol_version: _Optional[str] = ..., load_reports: _Optional[bool] = ...) -> None: ...

class OpenSequence(_message.Message):
    __slots__ = ("seq_id", "prompt_token_ids", "sampling", "num_output_tokens", "timeout_ms", "coupled", "cache_salt")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    NUM_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    COUPLED_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    num_output_tokens: int
    timeout_ms: int
    coupled: bool
    cache_salt: str
    def __init__(self, seq_id: _Optional[int] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., num_output_tokens: _Optional[int] = ..., timeout_ms: _Optional[int] = ..., coupled: _Optional[bool] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class SparseDistribution(_message.Message):
    __slots__ = ("token_ids", "probs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    probs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., probs: _Optional[_Iterable[float]] = ...) -> None: ...

class Proposal(_message.Message):
    __slots__ = ("seq_id", "start_position", "draft_token_ids", "draft_probs", "assumed_token_ids", "max_draft_tokens", "draft_seconds", "draft_parents", "catch_up_tokens", "draft_backlog_tokens")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    START_POSITION_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROBS_FIELD_NUMBER: _ClassVar[int]
    ASSUMED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PARENTS_FIELD_NUMBER: _ClassVar[int]
    CATCH_UP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_BACKLOG_TOKENS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    start_position: int
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_probs: _containers.RepeatedCompositeFieldContainer[SparseDistribution]
    assumed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_draft_tokens: int
    draft_seconds: float
    draft_parents: _containers.RepeatedScalarFieldContainer[int]
    catch_up_tokens: int
    draft_backlog_tokens: int
    def __init__(self, seq_id: _Optional[int] = ..., start_position: _Optional[int] = ..., draft_token_ids: _Optional[_Iterable[int]] = ..., draft_probs: _Optional[_Iterable[_Union[SparseDistribution, _Mapping]]] = ..., assumed_token_ids: _Optional[_Iterable[int]] = ..., max_draft_tokens: _Optional[int] = ..., draft_seconds: _Optional[float] = ..., draft_parents: _Optional[_Iterable[int]] = ..., catch_up_tokens: _Optional[int] = ..., draft_backlog_tokens: _Optional[int] = ...) -> None: ...

class CloseSequence(_message.Message):
    __slots__ = ("seq_id",)
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    def __init__(self, seq_id: _Optional[int] = ...) -> None: ...

class VerifierMessage(_message.Message):
    __slots__ = ("welcome", "verdict", "error", "dropped", "load")
    WELCOME_FIELD_NUMBER: _ClassVar[int]
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    welcome: Welcome
    verdict: Verdict
    error: SequenceError
    dropped: ProposalDropped
    load: VerifierLoad
    def __init__(self, welcome: _Optional[_Union[Welcome, _Mapping]] = ..., verdict: _Optional[_Union[Verdict, _Mapping]] = ..., error: _Optional[_Union[SequenceError, _Mapping]] = ..., dropped: _Optional[_Union[ProposalDropped, _Mapping]] = ..., load: _Optional[_Union[VerifierLoad, _Mapping]] = ...) -> None: ...

class VerifierLoad(_message.Message):
    __slots__ = ("num_running", "num_waiting", "kv_cache_usage", "num_free_blocks", "draining")
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_free_blocks: int
    draining: bool
    def __init__(self, num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., kv_cache_usage: _Optional[float] = ..., num_free_blocks: _Optional[int] = ..., draining: _Optional[bool] = ...) -> None: ...

class Welcome(_message.Message):
    __slots__ = ("info",)
    INFO_FIELD_NUMBER: _ClassVar[int]
    info: VerifierInfo
    def __init__(self, info: _Optional[_Union[VerifierInfo, _Mapping]] = ...) -> None: ...

class Verdict(_message.Message):
    __slots__ = ("seq_id", "start_position", "num_accepted", "token_ids", "finish_reason", "batch_size", "step_time_s", "next_draft_tokens", "step", "step_verdicts", "plain_from")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    START_POSITION_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_S_FIELD_NUMBER: _ClassVar[int]
    NEXT_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    STEP_VERDICTS_FIELD_NUMBER: _ClassVar[int]
    PLAIN_FROM_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    start_position: int
    num_accepted: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: _common_pb2.FinishReason
    batch_size: int
    step_time_s: float
    next_draft_tokens: int
    step: int
    step_verdicts: int
    plain_from: int
    def __init__(self, seq_id: _Optional[int] = ..., start_position: _Optional[int] = ..., num_accepted: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., batch_size: _Optional[int] = ..., step_time_s: _Optional[float] = ..., next_draft_tokens: _Optional[int] = ..., step: _Optional[int] = ..., step_verdicts: _Optional[int] = ..., plain_from: _Optional[int] = ...) -> None: ...

class ProposalDropped(_message.Message):
    __slots__ = ("seq_id", "start_position", "num_verified")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    START_POSITION_FIELD_NUMBER: _ClassVar[int]
    NUM_VERIFIED_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    start_position: int
    num_verified: int
    def __init__(self, seq_id: _Optional[int] = ..., start_position: _Optional[int] = ..., num_verified: _Optional[int] = ...) -> None: ...

class SequenceError(_message.Message):
    __slots__ = ("seq_id", "code", "message")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    code: int
    message: str
    def __init__(self, seq_id: _Optional[int] = ..., code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...
