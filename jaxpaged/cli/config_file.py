"""``--config FILE.yaml``: a command's flags written as a YAML mapping, vLLM's format::

    model: Qwen/Qwen2.5-0.5B-Instruct
    max-model-len: 4096          # or max_model_len
    enable-prefix-caching: false
    served-model-name: [qwen, qwen-small]

Each key is a flag of the command (dashes or underscores), its value checked as that flag's
is; the file's values become the defaults of the command line, so a flag (or MODEL) given on
the command line wins.
"""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Sequence
from typing import Any

__all__ = ["mapping_to_argv", "parse_args_with_config"]


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Long option name (without dashes) -> its action; the positional MODEL as 'model'."""
    found: dict[str, argparse.Action] = {}
    for action in parser._actions:
        for flag in action.option_strings:
            if flag.startswith("--"):
                found.setdefault(flag[2:], action)
    return found


def _words(key: str, value: Any, action: argparse.Action, path: str) -> list[str]:
    flag = f"--{key}"
    if isinstance(action, argparse.BooleanOptionalAction):
        if not isinstance(value, bool):
            raise ValueError(f"{path}: {key} must be true or false, got {value!r}")
        return [flag if value else f"--no-{key}"]
    if action.nargs == 0:  # store_true
        if not isinstance(value, bool):
            raise ValueError(f"{path}: {key} must be true or false, got {value!r}")
        return [flag] if value else []
    if isinstance(value, list):
        if action.nargs not in ("+", "*"):
            raise ValueError(f"{path}: {key} takes one value, got a list {value!r}")
        return [flag, *map(str, value)]
    if isinstance(value, bool):
        value = str(value).lower()
    if value is None:
        raise ValueError(f"{path}: {key} has no value")
    return [flag, str(value)]


def parse_args_with_config(
    parser: argparse.ArgumentParser, argv: Sequence[str]
) -> argparse.Namespace:
    """``parser.parse_args(argv)``, where ``--config FILE`` supplies defaults. A bad file,
    key or value is a parser error naming it."""
    argv = list(argv)
    paths = [i for i, word in enumerate(argv) if word == "--config" or word.startswith("--config=")]
    if not paths:
        return parser.parse_args(argv)
    if len(paths) > 1:
        parser.error("--config given more than once")
    i = paths[0]
    if argv[i] == "--config":
        if i + 1 >= len(argv):
            parser.error("--config needs a FILE")
        path, rest = argv[i + 1], argv[:i] + argv[i + 2 :]
    else:
        path, rest = argv[i].split("=", 1)[1], argv[:i] + argv[i + 1 :]
    try:
        words = _file_words(parser, path)
    except (OSError, ValueError) as e:
        parser.error(f"--config: {e}")
    parser.set_defaults(**{**vars(parser.parse_args(words)), "config": path})
    return parser.parse_args(rest)


def _file_words(parser: argparse.ArgumentParser, path: str) -> list[str]:
    import yaml

    with open(path, encoding="utf-8") as f:
        try:
            data = yaml.safe_load(f)
        except yaml.YAMLError as e:
            raise ValueError(f"{path} is not valid YAML: {e}") from None
    if data is None:
        return []
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a mapping of flag names to values")
    return mapping_to_argv(parser, data, path)


def mapping_to_argv(parser: argparse.ArgumentParser, data: dict, source: str) -> list[str]:
    """The command-line words for a mapping of flag names (dashes or underscores) to values,
    each value checked as its flag's is; ValueError naming ``source`` and the key for an
    unknown flag or a value of the wrong kind."""
    options = _options(parser)
    words: list[str] = []
    for raw_key, value in data.items():
        key = str(raw_key).replace("_", "-")
        if key == "config" or key not in options:
            close = difflib.get_close_matches(key, list(options), n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise ValueError(f"{source}: unknown flag {raw_key!r}{hint}")
        words += _words(key, value, options[key], source)
    return words
