"""Settings dataclasses whose fields carry their help text and command-line form
(:func:`setting`), and how those fields become argparse arguments (:func:`add_field_args`)."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["CliForm", "add_field_args", "setting", "unknown_message"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class CliForm:
    """How one EngineArgs field appears on the command line. A flag name without a leading
    dash is a positional argument; a bool field becomes ``--flag / --no-flag``."""

    flags: tuple[str, ...]
    parse: Callable[[str], Any] | None = None
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    nargs: str | None = None


def setting(default: Any, help: str, *flags: str, **cli: Any) -> Any:
    """A dataclass field with its help text and command-line form in the metadata."""
    return dataclasses.field(
        default=default, metadata={"help": help, "cli": CliForm(flags=flags, **cli)}
    )


def add_field_args(
    group: argparse._ArgumentGroup,
    fields: Sequence[dataclasses.Field[Any]],
    defaults: Mapping[str, Any],
) -> None:
    """One argument per field (``defaults`` replace fields' defaults). A positional flag
    with option spellings takes either form (`serve MODEL` or `--model MODEL`), once."""
    for f in fields:
        default = defaults.get(f.name, f.default)
        flags = f.metadata["cli"].flags
        kwargs = argparse_kwargs(f, default)
        if flags[0].startswith("-"):
            group.add_argument(*flags, **kwargs)
            continue
        group.add_argument(flags[0], action=GivenOnce, **kwargs)
        if flags[1:]:
            kwargs.pop("nargs")
            kwargs["help"] = argparse.SUPPRESS
            group.add_argument(*flags[1:], dest=f.name, action=GivenOnce, **kwargs)


class GivenOnce(argparse.Action):
    """Stores a value that has two spellings (a positional and an option): an absent
    positional keeps what the option gave, and two different values are an error."""

    def __call__(self, parser, namespace, values, option_string=None):  # noqa: ANN001
        old = getattr(namespace, self.dest, None)
        if values is None or values == self.default:
            if old is not None:
                return  # an absent positional keeps the option's value
        elif old is not None and old != self.default and old != values:
            parser.error(f"{self.metavar or self.dest} given twice: {old!r} and {values!r}")
        setattr(namespace, self.dest, values)


def argparse_kwargs(f: dataclasses.Field[Any], default: Any) -> dict[str, Any]:
    """argparse.add_argument keywords for one field: the default, its help and CLI form."""
    cli: CliForm = f.metadata["cli"]
    help_text = f.metadata["help"]
    kwargs: dict[str, Any] = {"default": default}
    if default is not None:
        help_text += f" (default: {default})"
    if not cli.flags[0].startswith("-"):
        kwargs["nargs"] = "?"  # an optional positional: `serve [MODEL]`
    elif isinstance(f.default, bool):
        kwargs["action"] = argparse.BooleanOptionalAction
    kwargs["help"] = help_text.replace("%", "%%")
    if cli.parse is not None:
        kwargs["type"] = cli.parse
    if cli.choices is not None:
        kwargs["choices"] = cli.choices
    if cli.metavar is not None:
        kwargs["metavar"] = cli.metavar
    if cli.nargs is not None:
        kwargs["nargs"] = cli.nargs
    return kwargs


def unknown_message(key: str, names: tuple[str, ...]) -> str:
    close = difflib.get_close_matches(key, names, n=3)
    if close:
        return f"unknown engine argument {key!r}; did you mean {' or '.join(map(repr, close))}?"
    return f"unknown engine argument {key!r}; engine arguments are: {', '.join(names)}"
