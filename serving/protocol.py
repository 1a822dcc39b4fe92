"""OpenAI-compatible request bodies (/v1/completions, /v1/chat/completions) and their
conversion to :class:`jaxpaged.SamplingParams`.

Bodies are parsed strictly (JSON types must match: ``"max_tokens": "10"`` is an error, not
10) so that every mistake comes back as a 400 naming the field. No field is silently
ignored: an unknown field, or a known one jaxpaged does not honour (:data:`UNSUPPORTED_FIELDS`),
is a 400 naming it; the few fields accepted on purpose without effect are listed in
:data:`NO_EFFECT_FIELDS` (and in docs/architecture.md). A ``null`` value means "not set", as
in OpenAI's API. Extra sampling fields beyond OpenAI's (``top_k``, ``min_p``,
``repetition_penalty``, ``ignore_eos``, ...) are accepted at the top level, which is where the
``openai`` client's ``extra_body`` puts them.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from jaxpaged.sampling_params import SamplingParams, StructuredOutput
from jaxpaged.serving.errors import InvalidRequest, field_of

__all__ = [
    "NO_EFFECT_FIELDS",
    "UNSUPPORTED_FIELDS",
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "StrictModel",
    "DetokenizeRequest",
    "TokenizeRequest",
    "parse_body",
]

_OPENAI_MAX_COMPLETION_LOGPROBS = 5

# Accepted on purpose and without effect on the output (field -> why that is honest).
NO_EFFECT_FIELDS: dict[str, str] = {
    "user": "an end-user id kept for the caller's own records",
    "metadata": "tags kept for the caller's own records",
    "safety_identifier": "an end-user id for abuse monitoring",
    "prompt_cache_key": "prefix caching is automatic (content-addressed KV blocks)",
}

# Fields of OpenAI's API (or vLLM's extra fields) that jaxpaged does not honour (field ->
# why): a request that sets one gets a 400 naming it rather than an answer without it.
UNSUPPORTED_FIELDS: dict[str, str] = {
    **dict.fromkeys(
        ("audio", "modalities", "prediction", "web_search_options", "verbosity"),
        "not supported by a text-only engine",
    ),
    "reasoning_effort": "jaxpaged has no reasoning-effort control",
    "service_tier": "jaxpaged has one service tier",
    "store": "jaxpaged does not store completions",
    **dict.fromkeys(
        ("functions", "function_call"),
        "the legacy function-calling fields are not supported; use tools and tool_choice",
    ),
    "guided_decoding_backend": "jaxpaged has one grammar engine (llguidance)",
    "guided_whitespace_pattern": "not supported by jaxpaged's grammar engine",
    "suffix": "insertion (suffix) is not supported",
    "use_beam_search": "beam search is not supported",
}


class _Strict(BaseModel):
    """Strict types, no unknown fields; a null unsupported field counts as not sent."""

    model_config = ConfigDict(strict=True, extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _drop_null_unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if not (v is None and k in UNSUPPORTED_FIELDS)}
        return data


StrictModel = _Strict  # the base of request bodies built on these rules


class StreamOptions(_Strict):
    include_usage: bool = False


class JsonSchema(_Strict):
    """OpenAI's response_format.json_schema."""

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    # the schema is always enforced; false: its permissive reading (StructuredOutput.strict)
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None

    def structured_output(self) -> dict[str, Any] | None:
        if self.type == "json_object":
            return {"json_object": True}
        if self.type == "json_schema":
            if self.json_schema is None or self.json_schema.schema_ is None:
                raise InvalidRequest(
                    "response_format.json_schema.schema is required with type json_schema",
                    param="response_format",
                )
            if self.json_schema.strict is False:
                return {"json": self.json_schema.schema_, "strict": False}
            return {"json": self.json_schema.schema_}
        return None


class StructuredOutputs(_Strict):
    """vLLM's structured_outputs object (exactly one field)."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class _SamplingFields(_Strict):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    # structured output, vLLM's extra fields (at most one of them, or response_format)
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None
    # accepted without effect (NO_EFFECT_FIELDS)
    user: str | None = None
    metadata: dict[str, str] | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    # extra body fields (vLLM's names)
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # a logits processor the server registered (EngineArgs.logits_processors), by name
    logits_processor: str | None = None
    logits_processor_args: list[float] | None = None
    # vLLM's request priority (--scheduling-policy priority: lower first)
    priority: int | None = None
    # false: no speculative decoding for this request (jaxpaged's; docs/speculative.md)
    speculative: bool = True

    def _check_common(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise InvalidRequest(
                "stream_options is only allowed when stream is true", param="stream_options"
            )

    def _params(
        self,
        *,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
        tool_grammar: StructuredOutput | None = None,
    ) -> SamplingParams:
        kwargs: dict[str, Any] = {
            "n": self.n,
            "max_tokens": max_tokens,
            "logprobs": logprobs,
            "prompt_logprobs": prompt_logprobs,
            "ignore_eos": self.ignore_eos,
            "min_tokens": self.min_tokens,
            "stop": self.stop,
            "stop_token_ids": self.stop_token_ids,
            "skip_special_tokens": self.skip_special_tokens,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "seed": self.seed,
            "logit_bias": _logit_bias(self.logit_bias),
            "structured_output": self._structured_output(tool_grammar),
            "logits_processor": self.logits_processor,
            "logits_processor_args": tuple(self.logits_processor_args or ()),
            "priority": self.priority or 0,
            "speculative": self.speculative,
        }
        for name in (
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "repetition_penalty",
            "presence_penalty",
            "frequency_penalty",
        ):
            value = getattr(self, name)
            if value is not None:
                kwargs[name] = value
        try:
            return SamplingParams(**kwargs)
        except ValueError as e:
            raise InvalidRequest(str(e), param=field_of(str(e))) from e

    def _structured_output(
        self, tool_grammar: StructuredOutput | None = None
    ) -> StructuredOutput | None:
        """The one structured-output request among response_format, guided_*,
        structured_outputs and a forced tool call's grammar, or None."""
        asked: dict[str, dict[str, Any]] = {}
        if self.response_format is not None:
            spec = self.response_format.structured_output()
            if spec is not None:
                asked["response_format"] = spec
        for name, key in (
            ("guided_json", "json"),
            ("guided_regex", "regex"),
            ("guided_choice", "choice"),
            ("guided_grammar", "grammar"),
        ):
            if getattr(self, name) is not None:
                asked[name] = {key: getattr(self, name)}
        if tool_grammar is not None:
            asked["tool_choice"] = {"json": tool_grammar.json}
        if self.structured_outputs is not None:
            so = self.structured_outputs.model_dump(exclude_none=True)
            asked["structured_outputs"] = {
                ("json" if k == "json_" else k): v for k, v in so.items()
            }
        if len(asked) > 1:
            raise InvalidRequest(
                f"ask for one structured output at a time, got {sorted(asked)}",
                param=sorted(asked)[1],
            )
        if not asked:
            return None
        ((name, spec),) = asked.items()
        if isinstance(spec.get("json"), str):
            try:
                spec["json"] = json.loads(spec["json"])
            except json.JSONDecodeError as e:
                raise InvalidRequest(
                    f"{name}: the schema is not valid JSON: {e}", param=name
                ) from None
        try:
            return StructuredOutput(**spec)
        except ValueError as e:
            raise InvalidRequest(f"{name}: {e}", param=name) from None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias keys are token ids written as JSON strings."""
    if not bias:
        return None
    out: dict[int, float] = {}
    for key, value in bias.items():
        try:
            out[int(key)] = value
        except ValueError:
            raise InvalidRequest(
                f"logit_bias keys must be token ids (integers as strings), got {key!r}",
                param="logit_bias",
            ) from None
    return out


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    prompt_logprobs: int | None = None  # vLLM's extra field

    def prompts(self) -> list[str | list[int]]:
        """The prompts of this request (a list of strings or of token-id lists means several;
        the engine checks each)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:  # no prompt at all: nothing would reach the engine
            raise InvalidRequest("prompt must not be empty", param="prompt")
        if isinstance(p[0], int):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]

    def sampling_params(self) -> SamplingParams:
        self._check_common()
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidRequest(
                "best_of must equal n (beam search is not supported)", param="best_of"
            )
        if self.logprobs is not None and not 0 <= self.logprobs <= _OPENAI_MAX_COMPLETION_LOGPROBS:
            raise InvalidRequest(
                f"logprobs must be in [0, {_OPENAI_MAX_COMPLETION_LOGPROBS}], got {self.logprobs}",
                param="logprobs",
            )
        prompt_logprobs = self.prompt_logprobs
        if self.echo and self.logprobs is not None:  # the echoed prompt's logprobs
            prompt_logprobs = max(self.logprobs, prompt_logprobs or 0)
        return self._params(
            max_tokens=self.max_tokens, logprobs=self.logprobs, prompt_logprobs=prompt_logprobs
        )


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ImageUrl(_Strict):
    url: str  # a data:image/{png,jpeg,webp};base64 URL (http(s) fetching is off)
    detail: Literal["auto", "low", "high"] | None = None  # accepted, not used


class ImageUrlPart(_Strict):
    """An image of a vision-language model (OpenAI's ``image_url`` content part)."""

    type: Literal["image_url"]
    image_url: ImageUrl

    def __repr__(self) -> str:  # never the image's bytes (a validation error may log it)
        return f"ImageUrlPart(<{len(self.image_url.url)} characters>)"


class FunctionDefinition(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no arguments
    strict: bool | None = None  # honoured where the call is forced (tool_choice)


class ToolDefinition(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class ToolCallFunction(_Strict):
    name: str
    arguments: str  # JSON text


class MessageToolCall(_Strict):
    """A tool call an assistant message made earlier in the conversation."""

    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


# fields the openai client writes back with an assistant message it received; null only
_NULL_REPLY_FIELDS = ("refusal", "annotations", "audio", "function_call", "reasoning_content")


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart | ImageUrlPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # assistant messages
    tool_call_id: str | None = None  # tool messages: the call this is the result of

    @model_validator(mode="before")
    @classmethod
    def _drop_null_reply_fields(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if not (v is None and k in _NULL_REPLY_FIELDS)}
        return data

    def as_template_input(self, index: int = 0) -> dict[str, Any]:
        """The message as chat templates take it (tool-call arguments as objects, as
        Hugging Face templates expect); InvalidRequest for a misplaced tool field."""
        where = f"messages.{index}"
        if self.tool_calls and self.role != "assistant":
            raise InvalidRequest("tool_calls are allowed on assistant messages only", param=where)
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise InvalidRequest(
                "a tool message needs tool_call_id, and only a tool message may carry it",
                param=f"{where}.tool_call_id",
            )
        content = self.content
        if isinstance(content, list) and any(isinstance(p, ImageUrlPart) for p in content):
            # the parts as multimodal templates take them; chat_images decodes the images
            content = [p.model_dump(exclude_none=True) for p in content]
        elif isinstance(content, list):
            content = "".join(part.text for part in content)
        role = "system" if self.role == "developer" else self.role
        out: dict[str, Any] = {"role": role, "content": content or ""}
        if self.name is not None:  # templates that know names use it
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            out["tool_calls"] = [
                _template_tool_call(c, f"{where}.tool_calls.{i}")
                for i, c in enumerate(self.tool_calls)
            ]
        return out


def _template_tool_call(call: MessageToolCall, where: str) -> dict[str, Any]:
    try:
        arguments = json.loads(call.function.arguments)
    except json.JSONDecodeError as e:
        raise InvalidRequest(
            f"{where}.function.arguments is not valid JSON: {e}", param=where
        ) from None
    return {
        "id": call.id,
        "type": "function",
        "function": {"name": call.function.name, "arguments": arguments},
    }


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # e.g. {"enable_thinking": false}
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    prompt_logprobs: int | None = None  # vLLM's extra field

    def sampling_params(self, tool_grammar: StructuredOutput | None = None) -> SamplingParams:
        """``tool_grammar``: the structured output a forced tool_choice asks for."""
        self._check_common()
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequest("top_logprobs requires logprobs to be true", param="top_logprobs")
        if self.prompt_logprobs is not None and self.stream:
            raise InvalidRequest(
                "prompt_logprobs is not available when streaming", param="prompt_logprobs"
            )
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )
        return self._params(
            max_tokens=max_tokens,
            logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs,
            tool_grammar=tool_grammar,
        )

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.as_template_input(i) for i, m in enumerate(self.messages)]

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as chat templates take them (OpenAI's shape, nulls left out)."""
        if not self.tools:
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]


class TokenizeRequest(_Strict):
    """vLLM's /tokenize: a text prompt, or chat messages rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ToolDefinition] | None = None  # chat only
    add_special_tokens: bool = True  # text prompts only (a chat template adds its own)
    add_generation_prompt: bool = True  # chat only
    chat_template_kwargs: dict[str, Any] | None = None  # chat only
    return_token_strs: bool = False

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise InvalidRequest("exactly one of prompt or messages is required", param="prompt")

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.as_template_input(i) for i, m in enumerate(self.messages or ())]

    def template_tools(self) -> list[dict[str, Any]] | None:
        if not self.tools:
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


def parse_body(model: type[_Strict], body: bytes, refused: dict[str, str] | None = None) -> Any:
    """Parses and type-checks a JSON body; InvalidRequest names the first bad field.
    ``refused``: the API's fields refused by name, with why (Chat Completions':
    UNSUPPORTED_FIELDS)."""
    if not body.strip():
        raise InvalidRequest("request body is empty; expected a JSON object")
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        err = e.errors()[0]
        if err["type"] == "json_invalid":
            raise InvalidRequest(f"malformed JSON body: {err['msg']}") from None
        loc = ".".join(str(x) for x in err["loc"] if not _is_union_tag(x))
        if err["type"] == "missing":
            raise InvalidRequest(f"{loc} is required", param=loc or None) from None
        if err["type"] == "extra_forbidden":
            reasons = UNSUPPORTED_FIELDS if refused is None else refused
            raise InvalidRequest(_refusal(loc, reasons), param=loc or None) from None
        where = f"{loc}: " if loc else "body: "
        raise InvalidRequest(f"{where}{err['msg']}", param=loc or None) from None


def _refusal(loc: str, reasons: dict[str, str]) -> str:
    """Why a field that is not part of the request model is refused."""
    name = loc.rsplit(".", 1)[-1]
    if loc == name and name in reasons:
        return f"{name} is not supported by jaxpaged: {reasons[name]}"
    return (
        f"{loc} is not a field jaxpaged knows; it refuses fields it would not honour "
        "rather than ignore them"
    )


def _is_union_tag(x: object) -> bool:
    # pydantic puts the union member tried (e.g. 'str', 'list[int]') into loc
    return isinstance(x, str) and (
        x in ("str", "int", "float", "bool") or "[" in x or x == "function-after"
    )
