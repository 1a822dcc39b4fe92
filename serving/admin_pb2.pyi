from typing import ClassVar as _ClassVar

from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message

DESCRIPTOR: _descriptor.FileDescriptor

class UpdateWeightsRequest(_message.Message):
    __slots__ = ("path",)
    PATH_FIELD_NUMBER: _ClassVar[int]
    path: str
    def __init__(self, path: str | None = ...) -> None: ...

class UpdateWeightsResponse(_message.Message):
    __slots__ = ("load_seconds", "swap_seconds")
    LOAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SWAP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    load_seconds: float
    swap_seconds: float
    def __init__(
        self, load_seconds: float | None = ..., swap_seconds: float | None = ...
    ) -> None: ...
