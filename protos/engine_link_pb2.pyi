from splitspec.protos import verifier_pb2 as _verifier_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FrontCommand(_message.Message):
    __slots__ = ("submit", "abort", "refused", "malformed", "started")
    SUBMIT_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    MALFORMED_FIELD_NUMBER: _ClassVar[int]
    STARTED_FIELD_NUMBER: _ClassVar[int]
    submit: _verifier_pb2.SubmitRequest
    abort: _verifier_pb2.AbortRequest
    refused: str
    malformed: str
    started: FrontStarted
    def __init__(self, submit: _Optional[_Union[_verifier_pb2.SubmitRequest, _Mapping]] = ..., abort: _Optional[_Union[_verifier_pb2.AbortRequest, _Mapping]] = ..., refused: _Optional[str] = ..., malformed: _Optional[str] = ..., started: _Optional[_Union[FrontStarted, _Mapping]] = ...) -> None: ...

class FrontStarted(_message.Message):
    __slots__ = ("error",)
    ERROR_FIELD_NUMBER: _ClassVar[int]
    error: str
    def __init__(self, error: _Optional[str] = ...) -> None: ...

class EngineMessage(_message.Message):
    __slots__ = ("hello", "step", "serving", "alive")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    SERVING_FIELD_NUMBER: _ClassVar[int]
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    hello: EngineHello
    step: StepColumns
    serving: bool
    alive: bool
    def __init__(self, hello: _Optional[_Union[EngineHello, _Mapping]] = ..., step: _Optional[_Union[StepColumns, _Mapping]] = ..., serving: _Optional[bool] = ..., alive: _Optional[bool] = ...) -> None: ...

class StepColumns(_message.Message):
    __slots__ = ("request_ids", "token_counts", "token_ids", "counts_at", "verify_steps", "draft_tokens", "accepted_tokens", "fallbacks", "positions", "accepted_per_position", "rich_at", "rich")
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_COUNTS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    COUNTS_AT_FIELD_NUMBER: _ClassVar[int]
    VERIFY_STEPS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FALLBACKS_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_PER_POSITION_FIELD_NUMBER: _ClassVar[int]
    RICH_AT_FIELD_NUMBER: _ClassVar[int]
    RICH_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    token_counts: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    counts_at: _containers.RepeatedScalarFieldContainer[int]
    verify_steps: _containers.RepeatedScalarFieldContainer[int]
    draft_tokens: _containers.RepeatedScalarFieldContainer[int]
    accepted_tokens: _containers.RepeatedScalarFieldContainer[int]
    fallbacks: _containers.RepeatedScalarFieldContainer[int]
    positions: _containers.RepeatedScalarFieldContainer[int]
    accepted_per_position: _containers.RepeatedScalarFieldContainer[int]
    rich_at: _containers.RepeatedScalarFieldContainer[int]
    rich: _containers.RepeatedCompositeFieldContainer[_verifier_pb2.TokenDelta]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ..., token_counts: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., counts_at: _Optional[_Iterable[int]] = ..., verify_steps: _Optional[_Iterable[int]] = ..., draft_tokens: _Optional[_Iterable[int]] = ..., accepted_tokens: _Optional[_Iterable[int]] = ..., fallbacks: _Optional[_Iterable[int]] = ..., positions: _Optional[_Iterable[int]] = ..., accepted_per_position: _Optional[_Iterable[int]] = ..., rich_at: _Optional[_Iterable[int]] = ..., rich: _Optional[_Iterable[_Union[_verifier_pb2.TokenDelta, _Mapping]]] = ...) -> None: ...

class EngineHello(_message.Message):
    __slots__ = ("info", "kv_pages", "page_size", "tree_tokens")
    INFO_FIELD_NUMBER: _ClassVar[int]
    KV_PAGES_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    TREE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    info: _verifier_pb2.ModelInfo
    kv_pages: int
    page_size: int
    tree_tokens: int
    def __init__(self, info: _Optional[_Union[_verifier_pb2.ModelInfo, _Mapping]] = ..., kv_pages: _Optional[int] = ..., page_size: _Optional[int] = ..., tree_tokens: _Optional[int] = ...) -> None: ...
