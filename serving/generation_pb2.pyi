from collections.abc import Iterable as _Iterable
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar

from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from google.protobuf.internal import containers as _containers

DESCRIPTOR: _descriptor.FileDescriptor

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Iterable[int] | None = ...) -> None: ...

class ToolCall(_message.Message):
    __slots__ = ("id", "name", "arguments")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    arguments: str
    def __init__(
        self, id: str | None = ..., name: str | None = ..., arguments: str | None = ...
    ) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "tool_calls", "tool_call_id", "images")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    tool_call_id: str
    images: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(
        self,
        role: str | None = ...,
        content: str | None = ...,
        tool_calls: _Iterable[ToolCall | _Mapping] | None = ...,
        tool_call_id: str | None = ...,
        images: _Iterable[bytes] | None = ...,
    ) -> None: ...

class Tool(_message.Message):
    __slots__ = ("name", "description", "parameters")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    parameters: str
    def __init__(
        self,
        name: str | None = ...,
        description: str | None = ...,
        parameters: str | None = ...,
    ) -> None: ...

class ToolChoice(_message.Message):
    __slots__ = ("mode", "function")
    MODE_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_FIELD_NUMBER: _ClassVar[int]
    mode: str
    function: str
    def __init__(self, mode: str | None = ..., function: str | None = ...) -> None: ...

class Chat(_message.Message):
    __slots__ = ("messages", "tools", "tool_choice", "parallel_tool_calls")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CHOICE_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    tools: _containers.RepeatedCompositeFieldContainer[Tool]
    tool_choice: ToolChoice
    parallel_tool_calls: bool
    def __init__(
        self,
        messages: _Iterable[ChatMessage | _Mapping] | None = ...,
        tools: _Iterable[Tool | _Mapping] | None = ...,
        tool_choice: ToolChoice | _Mapping | None = ...,
        parallel_tool_calls: bool | None = ...,
    ) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = (
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "seed",
        "n",
        "logprobs",
        "max_tokens",
        "min_tokens",
        "ignore_eos",
        "stop_token_ids",
        "stop",
        "include_stop_str_in_output",
        "skip_special_tokens",
        "logit_bias",
        "prompt_logprobs",
        "structured_output",
        "priority",
    )
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: int | None = ..., value: float | None = ...) -> None: ...

    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    seed: int
    n: int
    logprobs: int
    max_tokens: int
    min_tokens: int
    ignore_eos: bool
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    stop: _containers.RepeatedScalarFieldContainer[str]
    include_stop_str_in_output: bool
    skip_special_tokens: bool
    logit_bias: _containers.ScalarMap[int, float]
    prompt_logprobs: int
    structured_output: StructuredOutput
    priority: int
    def __init__(
        self,
        temperature: float | None = ...,
        top_p: float | None = ...,
        top_k: int | None = ...,
        min_p: float | None = ...,
        repetition_penalty: float | None = ...,
        presence_penalty: float | None = ...,
        frequency_penalty: float | None = ...,
        seed: int | None = ...,
        n: int | None = ...,
        logprobs: int | None = ...,
        max_tokens: int | None = ...,
        min_tokens: int | None = ...,
        ignore_eos: bool | None = ...,
        stop_token_ids: _Iterable[int] | None = ...,
        stop: _Iterable[str] | None = ...,
        include_stop_str_in_output: bool | None = ...,
        skip_special_tokens: bool | None = ...,
        logit_bias: _Mapping[int, float] | None = ...,
        prompt_logprobs: int | None = ...,
        structured_output: StructuredOutput | _Mapping | None = ...,
        priority: int | None = ...,
    ) -> None: ...

class Choices(_message.Message):
    __slots__ = ("choices",)
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    choices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, choices: _Iterable[str] | None = ...) -> None: ...

class StructuredOutput(_message.Message):
    __slots__ = ("json", "json_object", "regex", "choice", "grammar")
    JSON_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    json: str
    json_object: bool
    regex: str
    choice: Choices
    grammar: str
    def __init__(
        self,
        json: str | None = ...,
        json_object: bool | None = ...,
        regex: str | None = ...,
        choice: Choices | _Mapping | None = ...,
        grammar: str | None = ...,
    ) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = (
        "request_id",
        "text",
        "token_ids",
        "chat",
        "sampling_params",
        "stream",
        "lora_name",
    )
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: TokenIds
    chat: Chat
    sampling_params: SamplingParams
    stream: bool
    lora_name: str
    def __init__(
        self,
        request_id: str | None = ...,
        text: str | None = ...,
        token_ids: TokenIds | _Mapping | None = ...,
        chat: Chat | _Mapping | None = ...,
        sampling_params: SamplingParams | _Mapping | None = ...,
        stream: bool | None = ...,
        lora_name: str | None = ...,
    ) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: int | None = ..., logprob: float | None = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(
        self,
        token_id: int | None = ...,
        logprob: float | None = ...,
        top: _Iterable[TopLogprob | _Mapping] | None = ...,
    ) -> None: ...

class CompletionDelta(_message.Message):
    __slots__ = (
        "index",
        "token_ids",
        "text",
        "logprobs",
        "finish_reason",
        "stop_reason",
        "tool_calls",
    )
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    finish_reason: str
    stop_reason: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    def __init__(
        self,
        index: int | None = ...,
        token_ids: _Iterable[int] | None = ...,
        text: str | None = ...,
        logprobs: _Iterable[TokenLogprob | _Mapping] | None = ...,
        finish_reason: str | None = ...,
        stop_reason: str | None = ...,
        tool_calls: _Iterable[ToolCall | _Mapping] | None = ...,
    ) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_prompt_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    def __init__(
        self,
        prompt_tokens: int | None = ...,
        completion_tokens: int | None = ...,
        cached_prompt_tokens: int | None = ...,
    ) -> None: ...

class Timings(_message.Message):
    __slots__ = ("arrival_time", "queue_time_s", "time_to_first_token_s", "e2e_latency_s")
    ARRIVAL_TIME_FIELD_NUMBER: _ClassVar[int]
    QUEUE_TIME_S_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_FIRST_TOKEN_S_FIELD_NUMBER: _ClassVar[int]
    E2E_LATENCY_S_FIELD_NUMBER: _ClassVar[int]
    arrival_time: float
    queue_time_s: float
    time_to_first_token_s: float
    e2e_latency_s: float
    def __init__(
        self,
        arrival_time: float | None = ...,
        queue_time_s: float | None = ...,
        time_to_first_token_s: float | None = ...,
        e2e_latency_s: float | None = ...,
    ) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = (
        "request_id",
        "outputs",
        "finished",
        "usage",
        "timings",
        "prompt_token_ids",
        "prompt_logprobs",
    )
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    outputs: _containers.RepeatedCompositeFieldContainer[CompletionDelta]
    finished: bool
    usage: Usage
    timings: Timings
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(
        self,
        request_id: str | None = ...,
        outputs: _Iterable[CompletionDelta | _Mapping] | None = ...,
        finished: bool | None = ...,
        usage: Usage | _Mapping | None = ...,
        timings: Timings | _Mapping | None = ...,
        prompt_token_ids: _Iterable[int] | None = ...,
        prompt_logprobs: _Iterable[TokenLogprob | _Mapping] | None = ...,
    ) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: str | None = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = (
        "served_model_name",
        "model_path",
        "model_type",
        "vocab_size",
        "max_model_len",
        "num_layers",
        "hidden_size",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "eos_token_ids",
    )
    SERVED_MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    MODEL_TYPE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_HEADS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    served_model_name: str
    model_path: str
    model_type: str
    vocab_size: int
    max_model_len: int
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(
        self,
        served_model_name: str | None = ...,
        model_path: str | None = ...,
        model_type: str | None = ...,
        vocab_size: int | None = ...,
        max_model_len: int | None = ...,
        num_layers: int | None = ...,
        hidden_size: int | None = ...,
        num_heads: int | None = ...,
        num_kv_heads: int | None = ...,
        head_dim: int | None = ...,
        eos_token_ids: _Iterable[int] | None = ...,
    ) -> None: ...

class GetServerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServerInfo(_message.Message):
    __slots__ = (
        "version",
        "state",
        "engine_config",
        "num_running",
        "num_waiting",
        "num_swapped",
        "kv_cache_usage",
        "num_kv_blocks",
        "num_free_blocks",
        "num_preemptions",
        "in_flight_requests",
        "max_queue_len",
    )
    class EngineConfigEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: str | None = ..., value: str | None = ...) -> None: ...

    VERSION_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_CONFIG_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_SWAPPED_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUE_LEN_FIELD_NUMBER: _ClassVar[int]
    version: str
    state: str
    engine_config: _containers.ScalarMap[str, str]
    num_running: int
    num_waiting: int
    num_swapped: int
    kv_cache_usage: float
    num_kv_blocks: int
    num_free_blocks: int
    num_preemptions: int
    in_flight_requests: int
    max_queue_len: int
    def __init__(
        self,
        version: str | None = ...,
        state: str | None = ...,
        engine_config: _Mapping[str, str] | None = ...,
        num_running: int | None = ...,
        num_waiting: int | None = ...,
        num_swapped: int | None = ...,
        kv_cache_usage: float | None = ...,
        num_kv_blocks: int | None = ...,
        num_free_blocks: int | None = ...,
        num_preemptions: int | None = ...,
        in_flight_requests: int | None = ...,
        max_queue_len: int | None = ...,
    ) -> None: ...

class EmbedInput(_message.Message):
    __slots__ = ("text", "token_ids")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: TokenIds
    def __init__(
        self, text: str | None = ..., token_ids: TokenIds | _Mapping | None = ...
    ) -> None: ...

class EmbedRequest(_message.Message):
    __slots__ = ("inputs", "truncate_prompt_tokens", "dimensions")
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    inputs: _containers.RepeatedCompositeFieldContainer[EmbedInput]
    truncate_prompt_tokens: int
    dimensions: int
    def __init__(
        self,
        inputs: _Iterable[EmbedInput | _Mapping] | None = ...,
        truncate_prompt_tokens: int | None = ...,
        dimensions: int | None = ...,
    ) -> None: ...

class Embedding(_message.Message):
    __slots__ = ("values", "prompt_tokens")
    VALUES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[float]
    prompt_tokens: int
    def __init__(
        self, values: _Iterable[float] | None = ..., prompt_tokens: int | None = ...
    ) -> None: ...

class EmbedResponse(_message.Message):
    __slots__ = ("embeddings", "prompt_tokens")
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    embeddings: _containers.RepeatedCompositeFieldContainer[Embedding]
    prompt_tokens: int
    def __init__(
        self,
        embeddings: _Iterable[Embedding | _Mapping] | None = ...,
        prompt_tokens: int | None = ...,
    ) -> None: ...
