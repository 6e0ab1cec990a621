from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TensorMeta(_message.Message):
    __slots__ = ("name", "dtype", "shape", "frame", "request_id", "in_buffer", "buffer_offset", "buffer_end")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    FRAME_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    IN_BUFFER_FIELD_NUMBER: _ClassVar[int]
    BUFFER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    BUFFER_END_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    frame: int
    request_id: str
    in_buffer: bool
    buffer_offset: int
    buffer_end: int
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., frame: _Optional[int] = ..., request_id: _Optional[str] = ..., in_buffer: _Optional[bool] = ..., buffer_offset: _Optional[int] = ..., buffer_end: _Optional[int] = ...) -> None: ...

class CudaIpcBuffer(_message.Message):
    __slots__ = ("device", "handle", "size_bytes", "offset_bytes", "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    EVENT_SYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    device: str
    handle: bytes
    size_bytes: int
    offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    def __init__(self, device: _Optional[str] = ..., handle: _Optional[bytes] = ..., size_bytes: _Optional[int] = ..., offset_bytes: _Optional[int] = ..., ref_counter_handle: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ..., event_handle: _Optional[bytes] = ..., event_sync_required: _Optional[bool] = ...) -> None: ...

class DrafterIdentity(_message.Message):
    __slots__ = ("name", "instance_epoch", "session")
    NAME_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    name: str
    instance_epoch: int
    session: int
    def __init__(self, name: _Optional[str] = ..., instance_epoch: _Optional[int] = ..., session: _Optional[int] = ...) -> None: ...

class Register(_message.Message):
    __slots__ = ("algorithm", "draft_model", "vocab_size", "hidden_state_layers", "capacity", "max_tree_nodes", "metrics_port", "metrics_host", "device", "bets", "visible_gpus")
    ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MODEL_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_STATE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    MAX_TREE_NODES_FIELD_NUMBER: _ClassVar[int]
    METRICS_PORT_FIELD_NUMBER: _ClassVar[int]
    METRICS_HOST_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    BETS_FIELD_NUMBER: _ClassVar[int]
    VISIBLE_GPUS_FIELD_NUMBER: _ClassVar[int]
    algorithm: str
    draft_model: str
    vocab_size: int
    hidden_state_layers: _containers.RepeatedScalarFieldContainer[int]
    capacity: int
    max_tree_nodes: int
    metrics_port: int
    metrics_host: str
    device: str
    bets: bool
    visible_gpus: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, algorithm: _Optional[str] = ..., draft_model: _Optional[str] = ..., vocab_size: _Optional[int] = ..., hidden_state_layers: _Optional[_Iterable[int]] = ..., capacity: _Optional[int] = ..., max_tree_nodes: _Optional[int] = ..., metrics_port: _Optional[int] = ..., metrics_host: _Optional[str] = ..., device: _Optional[str] = ..., bets: _Optional[bool] = ..., visible_gpus: _Optional[_Iterable[str]] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("num_requests", "steps", "cuda_ipc_ready", "buffer_consumed")
    NUM_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_READY_FIELD_NUMBER: _ClassVar[int]
    BUFFER_CONSUMED_FIELD_NUMBER: _ClassVar[int]
    num_requests: int
    steps: int
    cuda_ipc_ready: bool
    buffer_consumed: int
    def __init__(self, num_requests: _Optional[int] = ..., steps: _Optional[int] = ..., cuda_ipc_ready: _Optional[bool] = ..., buffer_consumed: _Optional[int] = ...) -> None: ...

class WireTree(_message.Message):
    __slots__ = ("request_id", "tokens", "parents")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    tokens: _containers.RepeatedScalarFieldContainer[int]
    parents: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., tokens: _Optional[_Iterable[int]] = ..., parents: _Optional[_Iterable[int]] = ...) -> None: ...

class DraftReply(_message.Message):
    __slots__ = ("step_id", "trees", "draft_seconds", "unknown_request_ids", "received_unix_ns", "sent_unix_ns", "buffer_consumed")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    TREES_FIELD_NUMBER: _ClassVar[int]
    DRAFT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    UNKNOWN_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    SENT_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    BUFFER_CONSUMED_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    trees: _containers.RepeatedCompositeFieldContainer[WireTree]
    draft_seconds: float
    unknown_request_ids: _containers.RepeatedScalarFieldContainer[str]
    received_unix_ns: int
    sent_unix_ns: int
    buffer_consumed: int
    def __init__(self, step_id: _Optional[int] = ..., trees: _Optional[_Iterable[_Union[WireTree, _Mapping]]] = ..., draft_seconds: _Optional[float] = ..., unknown_request_ids: _Optional[_Iterable[str]] = ..., received_unix_ns: _Optional[int] = ..., sent_unix_ns: _Optional[int] = ..., buffer_consumed: _Optional[int] = ...) -> None: ...

class WireBet(_message.Message):
    __slots__ = ("request_id", "outcome", "tree")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    outcome: _containers.RepeatedScalarFieldContainer[int]
    tree: WireTree
    def __init__(self, request_id: _Optional[str] = ..., outcome: _Optional[_Iterable[int]] = ..., tree: _Optional[_Union[WireTree, _Mapping]] = ...) -> None: ...

class DraftBets(_message.Message):
    __slots__ = ("step_id", "bets", "draft_seconds", "received_unix_ns", "sent_unix_ns")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    BETS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    SENT_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    bets: _containers.RepeatedCompositeFieldContainer[WireBet]
    draft_seconds: float
    received_unix_ns: int
    sent_unix_ns: int
    def __init__(self, step_id: _Optional[int] = ..., bets: _Optional[_Iterable[_Union[WireBet, _Mapping]]] = ..., draft_seconds: _Optional[float] = ..., received_unix_ns: _Optional[int] = ..., sent_unix_ns: _Optional[int] = ...) -> None: ...

class DrafterMessage(_message.Message):
    __slots__ = ("sender", "register", "heartbeat", "draft_reply", "draft_bets", "tensors")
    SENDER_FIELD_NUMBER: _ClassVar[int]
    REGISTER_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    DRAFT_REPLY_FIELD_NUMBER: _ClassVar[int]
    DRAFT_BETS_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    sender: DrafterIdentity
    register: Register
    heartbeat: Heartbeat
    draft_reply: DraftReply
    draft_bets: DraftBets
    tensors: _containers.RepeatedCompositeFieldContainer[TensorMeta]
    def __init__(self, sender: _Optional[_Union[DrafterIdentity, _Mapping]] = ..., register: _Optional[_Union[Register, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., draft_reply: _Optional[_Union[DraftReply, _Mapping]] = ..., draft_bets: _Optional[_Union[DraftBets, _Mapping]] = ..., tensors: _Optional[_Iterable[_Union[TensorMeta, _Mapping]]] = ...) -> None: ...

class RegisterReply(_message.Message):
    __slots__ = ("accepted", "reason", "session", "heartbeat_timeout_seconds", "cuda_ipc")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    reason: str
    session: int
    heartbeat_timeout_seconds: float
    cuda_ipc: CudaIpcBuffer
    def __init__(self, accepted: _Optional[bool] = ..., reason: _Optional[str] = ..., session: _Optional[int] = ..., heartbeat_timeout_seconds: _Optional[float] = ..., cuda_ipc: _Optional[_Union[CudaIpcBuffer, _Mapping]] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("known",)
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    known: bool
    def __init__(self, known: _Optional[bool] = ...) -> None: ...

class OpenRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "grammar_kind", "grammar", "prompt_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_KIND_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    grammar_kind: str
    grammar: str
    prompt_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., grammar_kind: _Optional[str] = ..., grammar: _Optional[str] = ..., prompt_tokens: _Optional[int] = ...) -> None: ...

class DraftAsk(_message.Message):
    __slots__ = ("request_id", "new_token_ids", "max_nodes", "bet_taken", "num_bets")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_NODES_FIELD_NUMBER: _ClassVar[int]
    BET_TAKEN_FIELD_NUMBER: _ClassVar[int]
    NUM_BETS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    new_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_nodes: int
    bet_taken: int
    num_bets: int
    def __init__(self, request_id: _Optional[str] = ..., new_token_ids: _Optional[_Iterable[int]] = ..., max_nodes: _Optional[int] = ..., bet_taken: _Optional[int] = ..., num_bets: _Optional[int] = ...) -> None: ...

class DraftRequest(_message.Message):
    __slots__ = ("step_id", "asks")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    ASKS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    asks: _containers.RepeatedCompositeFieldContainer[DraftAsk]
    def __init__(self, step_id: _Optional[int] = ..., asks: _Optional[_Iterable[_Union[DraftAsk, _Mapping]]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("request_ids",)
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class VerifierMessage(_message.Message):
    __slots__ = ("verifier_epoch", "session", "register_reply", "heartbeat_reply", "open", "draft", "release", "tensors")
    VERIFIER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    REGISTER_REPLY_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_REPLY_FIELD_NUMBER: _ClassVar[int]
    OPEN_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    verifier_epoch: int
    session: int
    register_reply: RegisterReply
    heartbeat_reply: HeartbeatReply
    open: OpenRequest
    draft: DraftRequest
    release: ReleaseRequest
    tensors: _containers.RepeatedCompositeFieldContainer[TensorMeta]
    def __init__(self, verifier_epoch: _Optional[int] = ..., session: _Optional[int] = ..., register_reply: _Optional[_Union[RegisterReply, _Mapping]] = ..., heartbeat_reply: _Optional[_Union[HeartbeatReply, _Mapping]] = ..., open: _Optional[_Union[OpenRequest, _Mapping]] = ..., draft: _Optional[_Union[DraftRequest, _Mapping]] = ..., release: _Optional[_Union[ReleaseRequest, _Mapping]] = ..., tensors: _Optional[_Iterable[_Union[TensorMeta, _Mapping]]] = ...) -> None: ...
