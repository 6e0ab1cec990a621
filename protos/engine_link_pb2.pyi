from splitspec.protos import verifier_pb2 as _verifier_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
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
    step: _verifier_pb2.GenerateServerMessage
    serving: bool
    alive: bool
    def __init__(self, hello: _Optional[_Union[EngineHello, _Mapping]] = ..., step: _Optional[_Union[_verifier_pb2.GenerateServerMessage, _Mapping]] = ..., serving: _Optional[bool] = ..., alive: _Optional[bool] = ...) -> None: ...

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
