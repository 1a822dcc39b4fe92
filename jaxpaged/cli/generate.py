"""`jaxpaged generate [--model M] [--max-tokens N] [--temperature T] [--chat] PROMPT`

streams only the generated text to stdout as it comes (logs go to stderr); `--interactive`
opens the chat loop of `jaxpaged chat` instead (PROMPT, if given, is its first message)."""

from __future__ import annotations

import argparse
import sys
import threading
from collections.abc import Sequence

from jaxpaged.cli import terminal
from jaxpaged.engine import Prompt


def _parse_args(argv: Sequence[str] | None, prog: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=prog, description=__doc__)
    p.add_argument("prompt", metavar="PROMPT", nargs="?")
    terminal.add_engine_flags(p)
    terminal.add_sampling_flags(p, max_tokens=128)
    p.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template")
    p.add_argument(
        "-i", "--interactive", action="store_true", help="a chat loop (as `jaxpaged chat`)"
    )
    args = p.parse_args(argv)
    terminal.check_flags(p, args)
    if args.prompt is None and not args.interactive:
        p.error("PROMPT is required (or --interactive)")
    return args


def main(argv: Sequence[str] | None = None, prog: str = "python -m jaxpaged.generate") -> int:
    args = _parse_args(argv, prog)
    if args.interactive:
        from jaxpaged.cli import chat

        return chat.run(args, first_message=args.prompt)
    terminal.configure_logging(args.verbose)
    llm = terminal.one_sequence_llm(args, one_shot=True)
    if args.chat:
        prompt: Prompt = llm.apply_chat_template([{"role": "user", "content": args.prompt}])
    else:
        prompt = args.prompt
    params = terminal.sampling_params(args, min(args.max_tokens, args.max_model_len - 1))

    def write(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    try:
        with terminal.interrupt_sets(threading.Event()) as stop:
            reply = terminal.stream_reply(llm.engine, "generate-0", prompt, params, write, stop)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    write("\n")
    if args.verbose:
        print(reply.summary(), file=sys.stderr)
    return 130 if reply.finish_reason == "abort" else 0


if __name__ == "__main__":
    sys.exit(main())
