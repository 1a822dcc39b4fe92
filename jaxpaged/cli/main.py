"""`jaxpaged COMMAND [flags]`: the one command line, vLLM's shape (`jaxpaged serve MODEL`).

Each command is also a module of its own (`python -m jaxpaged.serve` and so on).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

__all__ = ["COMMANDS", "main"]

# command -> (module whose main(argv, prog=...) runs it, one line of help)
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("jaxpaged.cli.serve", "the gRPC + OpenAI-compatible HTTP server"),
    "generate": ("jaxpaged.cli.generate", "generate from one prompt, print the text"),
    "chat": ("jaxpaged.cli.chat", "chat with a model in the terminal"),
    "convert": ("jaxpaged.cli.convert", "save a model as an Orbax folder (faster loads)"),
    "run-batch": ("jaxpaged.cli.run_batch", "run an OpenAI batch file (JSON lines) offline"),
    "bench": ("jaxpaged.cli.bench", "run a benchmark of bench/ (source checkouts)"),
    "client": ("jaxpaged.cli.client", "stream a generation from a running server over gRPC"),
}


def _usage() -> str:
    lines = ["usage: jaxpaged COMMAND [flags]   (jaxpaged COMMAND --help for its flags)", ""]
    lines += [f"  {name:<9} {text}" for name, (_, text) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        from importlib.metadata import version

        print(f"jaxpaged {version('jaxpaged')}")
        return 0
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"jaxpaged: unknown command {command!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[command][0])
    return module.main(rest, prog=f"jaxpaged {command}")


if __name__ == "__main__":
    sys.exit(main())
