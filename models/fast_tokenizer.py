"""A model folder's tokenizer.json served by the ``tokenizers`` library, without transformers.

The terminal commands (``jaxpaged generate``, ``jaxpaged chat``) load their tokenizer this
way: importing transformers costs ~0.7 s of CPU, a fifth of a one-shot command's time to its
first token, for a tokenizer that is the same Rust ``tokenizers.Tokenizer`` underneath. This
class is that backend plus what transformers' generic fast tokenizer
(``PreTrainedTokenizerFast``) adds from tokenizer_config.json and special_tokens_map.json: the
named special tokens (registered as special added tokens), the chat template (rendered by
jaxpaged.models.chat_template as transformers renders it), and the decode clean-up flag. It
offers the part of transformers' tokenizer interface the engine, the LLM class and the
terminal commands use; servers keep transformers' own tokenizer (its full interface).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from tokenizers import AddedToken, Tokenizer

__all__ = ["SPECIAL_TOKEN_NAMES", "FastTokenizer"]

# transformers' named special tokens (SPECIAL_TOKENS_ATTRIBUTES)
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        value = json.load(f)
    return value if isinstance(value, dict) else {}


def _token(value: Any) -> AddedToken | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken's dict."""
    if isinstance(value, str):
        return AddedToken(value, special=True, normalized=False)
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return AddedToken(
            value["content"],
            single_word=bool(value.get("single_word", False)),
            lstrip=bool(value.get("lstrip", False)),
            rstrip=bool(value.get("rstrip", False)),
            normalized=bool(value.get("normalized", False)),
            special=True,
        )
    return None


def _chat_template(folder: str, config: Mapping[str, Any]) -> str | dict[str, str] | None:
    """chat_template.jinja (and additional_chat_templates/*.jinja), else chat_template.json,
    else tokenizer_config.json's entry (a string, or a list of named templates)."""
    path = os.path.join(folder, "chat_template.jinja")
    extra_dir = os.path.join(folder, "additional_chat_templates")
    named: dict[str, str] = {}
    if os.path.isdir(extra_dir):
        for name in sorted(os.listdir(extra_dir)):
            if name.endswith(".jinja"):
                with open(os.path.join(extra_dir, name), encoding="utf-8") as f:
                    named[name[: -len(".jinja")]] = f.read()
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            text = f.read()
        return {"default": text, **named} if named else text
    template = _read_json(os.path.join(folder, "chat_template.json")).get("chat_template")
    if template is None:
        template = config.get("chat_template")
    if isinstance(template, list):
        template = {t["name"]: t["template"] for t in template}
    return template


_CLEAN_UP = (
    (" .", "."),
    (" ?", "?"),
    (" !", "!"),
    (" ,", ","),
    (" ' ", "'"),
    (" n't", "n't"),
    (" 'm", "'m"),
    (" 's", "'s"),
    (" 've", "'ve"),
    (" 're", "'re"),
)


# transformers' apply_chat_template arguments this tokenizer does not offer (rather than
# passing them to the template as variables)
_UNSUPPORTED_CHAT_ARGS = frozenset(
    {"continue_final_message", "return_dict", "return_tensors", "padding", "truncation",
     "max_length", "tokenizer_kwargs", "return_assistant_tokens_mask", "sanitize_control_tokens"}
)  # fmt: skip


class FastTokenizer:
    """A folder's tokenizer.json with its special tokens and chat template (see the module's
    docstring); build it with :meth:`from_folder`."""

    def __init__(
        self,
        backend: Tokenizer,
        *,
        special_tokens: Mapping[str, str],
        extra_special_tokens: Sequence[str] = (),
        chat_template: str | dict[str, str] | None = None,
        clean_up_tokenization_spaces: bool = False,
    ) -> None:
        self.backend_tokenizer = backend
        self.special_tokens_map = dict(special_tokens)  # name -> token, as transformers'
        self.extra_special_tokens = list(extra_special_tokens)
        self.chat_template = chat_template
        self.clean_up_tokenization_spaces = clean_up_tokenization_spaces
        self._templates: dict[str, Any] = {}  # template text -> compiled template

    @classmethod
    def from_folder(cls, folder: str | os.PathLike) -> FastTokenizer:
        """ValueError when the folder has no tokenizer.json."""
        folder = os.fspath(folder)
        path = os.path.join(folder, "tokenizer.json")
        if not os.path.isfile(path):
            raise ValueError(f"{folder!r} has no tokenizer.json")
        backend = Tokenizer.from_file(path)
        config = _read_json(os.path.join(folder, "tokenizer_config.json"))
        stm = _read_json(os.path.join(folder, "special_tokens_map.json"))
        named: dict[str, AddedToken] = {}
        for name in SPECIAL_TOKEN_NAMES:
            token = _token(config.get(name)) or _token(stm.get(name))
            if token is not None:
                named[name] = token
        extra_value = config.get("extra_special_tokens") or config.get("additional_special_tokens")
        if extra_value is None:
            extra_value = stm.get("additional_special_tokens")
        extra: list[AddedToken] = []
        if isinstance(extra_value, Mapping):  # named extras (image_token, ...): variables too
            for name, value in extra_value.items():
                if (token := _token(value)) is not None:
                    named[name] = token
        elif isinstance(extra_value, list):
            extra = [t for t in (_token(v) for v in extra_value) if t is not None]
        known = {t.content for t in backend.get_added_tokens_decoder().values() if t.special}
        backend.add_special_tokens([t for t in [*named.values(), *extra] if t.content not in known])
        return cls(
            backend,
            special_tokens={name: t.content for name, t in named.items()},
            extra_special_tokens=[t.content for t in extra],
            chat_template=_chat_template(folder, config),
            clean_up_tokenization_spaces=bool(config.get("clean_up_tokenization_spaces", False)),
        )

    # ------------------------------------------------------------------ special tokens
    def _id(self, name: str) -> int | None:
        token = self.special_tokens_map.get(name)
        return None if token is None else self.backend_tokenizer.token_to_id(token)

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens_map.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens_map.get("eos_token")

    @property
    def pad_token(self) -> str | None:
        return self.special_tokens_map.get("pad_token")

    @property
    def unk_token(self) -> str | None:
        return self.special_tokens_map.get("unk_token")

    @property
    def bos_token_id(self) -> int | None:
        return self._id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._id("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._id("pad_token")

    @property
    def unk_token_id(self) -> int | None:
        return self._id("unk_token")

    @property
    def all_special_tokens(self) -> list[str]:
        tokens = [*self.special_tokens_map.values(), *self.extra_special_tokens]
        return list(dict.fromkeys(tokens))

    @property
    def all_special_ids(self) -> list[int]:
        ids = (self.backend_tokenizer.token_to_id(t) for t in self.all_special_tokens)
        return [i for i in ids if i is not None]

    # ------------------------------------------------------------------ vocabulary
    @property
    def vocab_size(self) -> int:
        """The base vocabulary (without added tokens), as transformers' ``vocab_size``."""
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=False)

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    def convert_ids_to_tokens(self, ids: int | Sequence[int]) -> Any:
        if isinstance(ids, int):
            return self.backend_tokenizer.id_to_token(ids)
        return [self.backend_tokenizer.id_to_token(int(i)) for i in ids]

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> Any:
        unk = self.unk_token_id
        if isinstance(tokens, str):
            found = self.backend_tokenizer.token_to_id(tokens)
            return unk if found is None else found
        return [self.convert_tokens_to_ids(t) for t in tokens]

    # ------------------------------------------------------------------ text
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: int | Sequence[int], skip_special_tokens: bool = False) -> str:
        if isinstance(ids, int):
            ids = [ids]
        text = self.backend_tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)
        # transformers skips its clean-up for BPE models (it eats spaces before punctuation)
        if self.clean_up_tokenization_spaces and (
            type(self.backend_tokenizer.model).__name__ != "BPE"
        ):
            for old, new in _CLEAN_UP:
                text = text.replace(old, new)
        return text

    # ------------------------------------------------------------------ chat
    def _template_text(self, chat_template: str | None, tools: Any) -> str:
        templates = self.chat_template
        if isinstance(templates, dict):
            if chat_template is not None and chat_template in templates:
                return templates[chat_template]
            if chat_template is None:
                if tools is not None and "tool_use" in templates:
                    return templates["tool_use"]
                if "default" in templates:
                    return templates["default"]
                raise ValueError(
                    "this tokenizer has several chat templates and no default: pass one of "
                    f"{sorted(templates)} as chat_template"
                )
            return chat_template
        if chat_template is not None:
            return chat_template
        if templates is None:
            raise ValueError(
                "this model's tokenizer has no chat template (tokenizer_config.json, "
                "chat_template.jinja): pass chat_template"
            )
        return templates

    def apply_chat_template(
        self,
        conversation: Sequence[Any],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = False,
        tokenize: bool = True,
        **variables: Any,
    ) -> str | list[int]:
        """The conversation through the chat template, as transformers'
        ``apply_chat_template``: the text, or (``tokenize``) its ids without added special
        tokens. ``variables``: extra template variables (they override special tokens)."""
        unsupported = sorted(_UNSUPPORTED_CHAT_ARGS & set(variables))
        if unsupported:
            raise ValueError(
                f"apply_chat_template: {unsupported} need transformers' tokenizer "
                "(tokenizer_mode='auto')"
            )
        # jinja2 (~0.08 s to import) only for a command that uses a chat template
        from jaxpaged.models.chat_template import compile_chat_template, render_chat

        text = self._template_text(chat_template, tools)
        template = self._templates.get(text)
        if template is None:
            template = self._templates[text] = compile_chat_template(text)
        rendered = render_chat(
            template,
            list(conversation),
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            variables={**self.special_tokens_map, **variables},
        )
        return self.encode(rendered, add_special_tokens=False) if tokenize else rendered
