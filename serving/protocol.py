"""OpenAI-compatible request bodies (/v1/completions, /v1/chat/completions) and their
conversion to :class:`jaxpaged.SamplingParams`.

Bodies are parsed strictly (JSON types must match: ``"max_tokens": "10"`` is an error, not
10) so that every mistake comes back as a 400 naming the field. Unknown fields are ignored,
as OpenAI clients send optional fields this server does not use. Extra sampling fields
beyond OpenAI's (``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos``, ...) are
accepted at the top level, which is where the ``openai`` client's ``extra_body`` puts them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from jaxpaged.sampling_params import SamplingParams
from jaxpaged.serving.frontend import InvalidRequest, field_of

__all__ = [
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "parse_body",
]

_OPENAI_MAX_COMPLETION_LOGPROBS = 5


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


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
    user: str | None = None
    # extra body fields (vLLM's names)
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def _check_common(self) -> None:
        if self.logit_bias:
            raise InvalidRequest("logit_bias is not supported", param="logit_bias")
        if self.stream_options is not None and not self.stream:
            raise InvalidRequest(
                "stream_options is only allowed when stream is true", param="stream_options"
            )

    def _params(self, *, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        kwargs: dict[str, Any] = {
            "n": self.n,
            "max_tokens": max_tokens,
            "logprobs": logprobs,
            "ignore_eos": self.ignore_eos,
            "min_tokens": self.min_tokens,
            "stop": self.stop,
            "stop_token_ids": self.stop_token_ids,
            "skip_special_tokens": self.skip_special_tokens,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "seed": self.seed,
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

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompts of this request (a list of strings or of token-id lists means several)."""
        p = self.prompt
        if isinstance(p, str):
            out: list[str | list[int]] = [p]
        elif not p:
            raise InvalidRequest("prompt must not be empty", param="prompt")
        elif isinstance(p[0], int):
            out = [list(p)]  # type: ignore[arg-type]
        else:
            out = list(p)  # type: ignore[arg-type]
        for q in out:
            if len(q) == 0:
                raise InvalidRequest("prompt must not be empty", param="prompt")
        return out

    def sampling_params(self) -> SamplingParams:
        self._check_common()
        if self.echo:
            raise InvalidRequest("echo is not supported", param="echo")
        if self.suffix:
            raise InvalidRequest("suffix is not supported", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidRequest(
                "best_of must equal n (beam search is not supported)", param="best_of"
            )
        if self.logprobs is not None and not 0 <= self.logprobs <= _OPENAI_MAX_COMPLETION_LOGPROBS:
            raise InvalidRequest(
                f"logprobs must be in [0, {_OPENAI_MAX_COMPLETION_LOGPROBS}], got {self.logprobs}",
                param="logprobs",
            )
        return self._params(max_tokens=self.max_tokens, logprobs=self.logprobs)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def as_template_input(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": content or ""}


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    def sampling_params(self) -> SamplingParams:
        self._check_common()
        if not self.messages:
            raise InvalidRequest("messages must not be empty", param="messages")
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequest("top_logprobs requires logprobs to be true", param="top_logprobs")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )
        return self._params(max_tokens=max_tokens, logprobs=logprobs)

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.as_template_input() for m in self.messages]


def parse_body(model: type[_Strict], body: bytes) -> Any:
    """Parses and type-checks a JSON body; InvalidRequest names the first bad field."""
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
        where = f"{loc}: " if loc else "body: "
        raise InvalidRequest(f"{where}{err['msg']}", param=loc or None) from None


def _is_union_tag(x: object) -> bool:
    # pydantic puts the union member tried (e.g. 'str', 'list[int]') into loc
    return isinstance(x, str) and (
        x in ("str", "int", "float", "bool") or "[" in x or x == "function-after"
    )
