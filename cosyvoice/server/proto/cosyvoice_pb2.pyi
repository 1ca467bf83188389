from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Request(_message.Message):
    __slots__ = ("sft_request", "zero_shot_request", "cross_lingual_request", "instruct_request", "seed", "speed", "stream", "final", "first_hop", "steps")
    SFT_REQUEST_FIELD_NUMBER: _ClassVar[int]
    ZERO_SHOT_REQUEST_FIELD_NUMBER: _ClassVar[int]
    CROSS_LINGUAL_REQUEST_FIELD_NUMBER: _ClassVar[int]
    INSTRUCT_REQUEST_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    SPEED_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    FIRST_HOP_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    sft_request: sftRequest
    zero_shot_request: zeroshotRequest
    cross_lingual_request: crosslingualRequest
    instruct_request: instructRequest
    seed: int
    speed: float
    stream: bool
    final: str
    first_hop: int
    steps: int
    def __init__(self, sft_request: _Optional[_Union[sftRequest, _Mapping]] = ..., zero_shot_request: _Optional[_Union[zeroshotRequest, _Mapping]] = ..., cross_lingual_request: _Optional[_Union[crosslingualRequest, _Mapping]] = ..., instruct_request: _Optional[_Union[instructRequest, _Mapping]] = ..., seed: _Optional[int] = ..., speed: _Optional[float] = ..., stream: _Optional[bool] = ..., final: _Optional[str] = ..., first_hop: _Optional[int] = ..., steps: _Optional[int] = ...) -> None: ...

class sftRequest(_message.Message):
    __slots__ = ("spk_id", "tts_text")
    SPK_ID_FIELD_NUMBER: _ClassVar[int]
    TTS_TEXT_FIELD_NUMBER: _ClassVar[int]
    spk_id: str
    tts_text: str
    def __init__(self, spk_id: _Optional[str] = ..., tts_text: _Optional[str] = ...) -> None: ...

class zeroshotRequest(_message.Message):
    __slots__ = ("tts_text", "prompt_text", "prompt_audio", "voice_id")
    TTS_TEXT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TEXT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_AUDIO_FIELD_NUMBER: _ClassVar[int]
    VOICE_ID_FIELD_NUMBER: _ClassVar[int]
    tts_text: str
    prompt_text: str
    prompt_audio: bytes
    voice_id: str
    def __init__(self, tts_text: _Optional[str] = ..., prompt_text: _Optional[str] = ..., prompt_audio: _Optional[bytes] = ..., voice_id: _Optional[str] = ...) -> None: ...

class crosslingualRequest(_message.Message):
    __slots__ = ("tts_text", "prompt_audio", "voice_id")
    TTS_TEXT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_AUDIO_FIELD_NUMBER: _ClassVar[int]
    VOICE_ID_FIELD_NUMBER: _ClassVar[int]
    tts_text: str
    prompt_audio: bytes
    voice_id: str
    def __init__(self, tts_text: _Optional[str] = ..., prompt_audio: _Optional[bytes] = ..., voice_id: _Optional[str] = ...) -> None: ...

class instructRequest(_message.Message):
    __slots__ = ("tts_text", "spk_id", "instruct_text", "prompt_audio")
    TTS_TEXT_FIELD_NUMBER: _ClassVar[int]
    SPK_ID_FIELD_NUMBER: _ClassVar[int]
    INSTRUCT_TEXT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_AUDIO_FIELD_NUMBER: _ClassVar[int]
    tts_text: str
    spk_id: str
    instruct_text: str
    prompt_audio: bytes
    def __init__(self, tts_text: _Optional[str] = ..., spk_id: _Optional[str] = ..., instruct_text: _Optional[str] = ..., prompt_audio: _Optional[bytes] = ...) -> None: ...

class Response(_message.Message):
    __slots__ = ("tts_audio",)
    TTS_AUDIO_FIELD_NUMBER: _ClassVar[int]
    tts_audio: bytes
    def __init__(self, tts_audio: _Optional[bytes] = ...) -> None: ...
