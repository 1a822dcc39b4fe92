"""`jaxpaged chat [--model M] [--system TEXT] [--max-tokens N] ...`: a chat in the terminal.

Type a message and press Enter; the reply streams as it is generated. Ctrl-C stops the reply
(the conversation goes on), Ctrl-D or /exit quits, /reset starts a new conversation. Each turn
sends the whole conversation through the model's chat template; the engine's prefix cache
still holds the earlier turns, so only the new tokens are computed (-v shows the count)."""

from __future__ import annotations

import argparse
import sys
import threading
from collections.abc import Sequence

from jaxpaged.cli import terminal
from jaxpaged.llm import LLM

PROMPT = ">>> "
EXIT_COMMANDS = ("/exit", "/quit", "/bye")
HELP = "Ctrl-C stops a reply; Ctrl-D or /exit quits; /reset forgets the conversation."


def _parse_args(argv: Sequence[str] | None, prog: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=prog, description=__doc__)
    terminal.add_engine_flags(p)
    terminal.add_sampling_flags(p, max_tokens=512)
    p.add_argument("--system", default=None, help="a system message that opens the chat")
    args = p.parse_args(argv)
    terminal.check_flags(p, args)
    return args


def main(argv: Sequence[str] | None = None, prog: str = "jaxpaged chat") -> int:
    return run(_parse_args(argv, prog))


def run(args: argparse.Namespace, *, first_message: str | None = None) -> int:
    """The chat loop on stdin / stdout (``args`` as :func:`_parse_args` makes them;
    ``first_message``: sent before the first prompt, as if typed). 130 after a Ctrl-C while
    loading or a second one during a reply."""
    try:
        return _loop(args, first_message)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


def _loop(args: argparse.Namespace, first_message: str | None) -> int:
    terminal.configure_logging(args.verbose)
    llm = terminal.one_sequence_llm(args)
    chat = Conversation(llm, system=getattr(args, "system", None))
    stop = threading.Event()
    print(HELP, file=sys.stderr, flush=True)
    pending = [first_message] if first_message else []
    turn = 0
    while True:
        if pending:
            line = pending.pop()
            print(f"{PROMPT}{line}", flush=True)
        else:
            try:
                line = input(PROMPT)
            except EOFError:
                print(flush=True)
                return 0
            except KeyboardInterrupt:  # at the prompt: a fresh line, as a shell does
                print(flush=True)
                continue
        text = line.strip()
        if not text:
            continue
        if text in EXIT_COMMANDS:
            return 0
        if text == "/reset":
            chat.reset()
            continue
        try:
            prompt = chat.prompt_for(text, reserve=1)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr, flush=True)
            continue
        room = args.max_model_len - len(prompt)
        params = terminal.sampling_params(args, min(args.max_tokens, room))

        def write(piece: str) -> None:
            sys.stdout.write(piece)
            sys.stdout.flush()

        with terminal.interrupt_sets(stop):
            reply = terminal.stream_reply(llm.engine, f"chat-{turn}", prompt, params, write, stop)
        turn += 1
        print(flush=True)
        if reply.finish_reason == "abort":
            print("[stopped]", file=sys.stderr, flush=True)
        if args.verbose:
            print(reply.summary(), file=sys.stderr, flush=True)
        chat.add_reply(text, reply.text)


class Conversation:
    """The messages so far, rendered through the model's chat template for each turn. The
    oldest exchanges are dropped when the next prompt would not fit in ``max_model_len``
    (a system message stays)."""

    def __init__(self, llm: LLM, *, system: str | None = None) -> None:
        self.llm = llm
        self.system = system
        self.messages: list[dict[str, str]] = []

    def reset(self) -> None:
        self.messages = []

    def _rendered(self, messages: list[dict[str, str]]) -> list[int]:
        opening = [] if self.system is None else [{"role": "system", "content": self.system}]
        return self.llm.apply_chat_template(opening + messages)

    def prompt_for(self, text: str, *, reserve: int) -> list[int]:
        """Token ids of the conversation with the user's ``text`` appended, leaving
        ``reserve`` tokens for the reply (ValueError if the message alone does not fit)."""
        limit = self.llm.engine.max_model_len - reserve
        messages = [*self.messages, {"role": "user", "content": text}]
        ids = self._rendered(messages)
        while len(ids) > limit and len(messages) > 1:
            messages = messages[2:] if len(messages) > 2 else messages[1:]
            ids = self._rendered(messages)
        if len(ids) > limit:
            raise ValueError(
                f"the message takes {len(ids)} tokens with the chat template, more than "
                f"--max-model-len {self.llm.engine.max_model_len} leaves for a reply"
            )
        self.messages = messages[:-1]  # what was dropped stays dropped
        return ids

    def add_reply(self, text: str, reply: str) -> None:
        self.messages += [
            {"role": "user", "content": text},
            {"role": "assistant", "content": reply},
        ]


if __name__ == "__main__":
    sys.exit(main())
