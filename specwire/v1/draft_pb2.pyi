from specwire.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RequestSpeculation(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REQUEST_SPECULATION_UNSPECIFIED: _ClassVar[RequestSpeculation]
    REQUEST_SPECULATION_FIXED: _ClassVar[RequestSpeculation]
REQUEST_SPECULATION_UNSPECIFIED: RequestSpeculation
REQUEST_SPECULATION_FIXED: RequestSpeculation

class GenerateRequest(_message.Message):
    __slots__ = ("text", "token_ids", "sampling", "stop", "num_speculative_tokens", "wire_mode", "cache_salt", "speculation")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WIRE_MODE_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: TokenIds
    sampling: _common_pb2.SamplingParams
    stop: _containers.RepeatedScalarFieldContainer[str]
    num_speculative_tokens: int
    wire_mode: _common_pb2.WireMode
    cache_salt: str
    speculation: RequestSpeculation
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., stop: _Optional[_Iterable[str]] = ..., num_speculative_tokens: _Optional[int] = ..., wire_mode: _Optional[_Union[_common_pb2.WireMode, str]] = ..., cache_salt: _Optional[str] = ..., speculation: _Optional[_Union[RequestSpeculation, str]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("chunk", "stats")
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    chunk: Chunk
    stats: Stats
    def __init__(self, chunk: _Optional[_Union[Chunk, _Mapping]] = ..., stats: _Optional[_Union[Stats, _Mapping]] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("token_ids", "text")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ...) -> None: ...

class Stats(_message.Message):
    __slots__ = ("finish_reason", "num_prompt_tokens", "num_generated_tokens", "num_rounds", "num_draft_tokens", "num_accepted_tokens", "accepted_per_position", "drafted_per_position", "wall_time_s", "time_to_first_token_s", "draft_time_s", "verify_wait_s", "num_speculative_tokens", "verify_time_s", "num_rejected_rounds", "proposal_bytes")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_PER_POSITION_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_PER_POSITION_FIELD_NUMBER: _ClassVar[int]
    WALL_TIME_S_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_FIRST_TOKEN_S_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TIME_S_FIELD_NUMBER: _ClassVar[int]
    VERIFY_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_TIME_S_FIELD_NUMBER: _ClassVar[int]
    NUM_REJECTED_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    PROPOSAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    finish_reason: _common_pb2.FinishReason
    num_prompt_tokens: int
    num_generated_tokens: int
    num_rounds: int
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_position: _containers.RepeatedScalarFieldContainer[int]
    drafted_per_position: _containers.RepeatedScalarFieldContainer[int]
    wall_time_s: float
    time_to_first_token_s: float
    draft_time_s: float
    verify_wait_s: float
    num_speculative_tokens: int
    verify_time_s: float
    num_rejected_rounds: int
    proposal_bytes: int
    def __init__(self, finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., num_prompt_tokens: _Optional[int] = ..., num_generated_tokens: _Optional[int] = ..., num_rounds: _Optional[int] = ..., num_draft_tokens: _Optional[int] = ..., num_accepted_tokens: _Optional[int] = ..., accepted_per_position: _Optional[_Iterable[int]] = ..., drafted_per_position: _Optional[_Iterable[int]] = ..., wall_time_s: _Optional[float] = ..., time_to_first_token_s: _Optional[float] = ..., draft_time_s: _Optional[float] = ..., verify_wait_s: _Optional[float] = ..., num_speculative_tokens: _Optional[int] = ..., verify_time_s: _Optional[float] = ..., num_rejected_rounds: _Optional[int] = ..., proposal_bytes: _Optional[int] = ...) -> None: ...
