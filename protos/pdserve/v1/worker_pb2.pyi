from protos.pdserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "model", "prefill_address", "output_token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    model: str
    prefill_address: str
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., model: _Optional[str] = ..., prefill_address: _Optional[str] = ..., output_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class DecodeStreamRequest(_message.Message):
    __slots__ = ("call_id", "start", "cancel", "timeout_s", "metadata")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    start: DecodeRequest
    cancel: bool
    timeout_s: float
    metadata: _containers.ScalarMap[str, str]
    def __init__(self, call_id: _Optional[int] = ..., start: _Optional[_Union[DecodeRequest, _Mapping]] = ..., cancel: _Optional[bool] = ..., timeout_s: _Optional[float] = ..., metadata: _Optional[_Mapping[str, str]] = ...) -> None: ...

class DecodeStreamEntry(_message.Message):
    __slots__ = ("call_id", "response", "end", "status_code", "status_message")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    STATUS_CODE_FIELD_NUMBER: _ClassVar[int]
    STATUS_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    response: _common_pb2.GenerateResponse
    end: bool
    status_code: int
    status_message: str
    def __init__(self, call_id: _Optional[int] = ..., response: _Optional[_Union[_common_pb2.GenerateResponse, _Mapping]] = ..., end: _Optional[bool] = ..., status_code: _Optional[int] = ..., status_message: _Optional[str] = ...) -> None: ...

class DecodeStreamResponse(_message.Message):
    __slots__ = ("entries", "draining", "grace_s")
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    GRACE_S_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[DecodeStreamEntry]
    draining: bool
    grace_s: float
    def __init__(self, entries: _Optional[_Iterable[_Union[DecodeStreamEntry, _Mapping]]] = ..., draining: _Optional[bool] = ..., grace_s: _Optional[float] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "model", "kv_transfer", "output_token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    model: str
    kv_transfer: _common_pb2.KVTransferParams
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., model: _Optional[str] = ..., kv_transfer: _Optional[_Union[_common_pb2.KVTransferParams, _Mapping]] = ..., output_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("request_id", "first_token_id", "first_logprob", "num_cached_tokens", "transfer", "first_text", "first_top_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_FIELD_NUMBER: _ClassVar[int]
    FIRST_TEXT_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    first_token_id: int
    first_logprob: float
    num_cached_tokens: int
    transfer: _common_pb2.KVTransferResult
    first_text: str
    first_top_logprobs: _common_pb2.TopLogprobs
    def __init__(self, request_id: _Optional[str] = ..., first_token_id: _Optional[int] = ..., first_logprob: _Optional[float] = ..., num_cached_tokens: _Optional[int] = ..., transfer: _Optional[_Union[_common_pb2.KVTransferResult, _Mapping]] = ..., first_text: _Optional[str] = ..., first_top_logprobs: _Optional[_Union[_common_pb2.TopLogprobs, _Mapping]] = ...) -> None: ...
