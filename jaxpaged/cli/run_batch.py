"""`jaxpaged run-batch -i requests.jsonl -o results.jsonl [MODEL] [flags]`: OpenAI's batch
file format run offline, as vLLM's `run-batch`.

Each input line is `{"custom_id", "method": "POST", "url", "body"}` with url
/v1/chat/completions, /v1/completions or /v1/responses; each output line is `{"id",
"custom_id", "response": {"status_code", "request_id", "body"}, "error"}`, written as the
request ends (completion order). A line that fails is written with `error` set and the batch
goes on. Rerun with the same -o to resume: lines already in it are skipped.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Callable, Sequence
from typing import Any

from jaxpaged.args import EngineArgs, positive_int

__all__ = ["build_parser", "main"]

log = logging.getLogger("jaxpaged.run_batch")


def build_parser(prog: str = "jaxpaged run-batch") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    b = p.add_argument_group("batch")
    b.add_argument("-i", "--input-file", required=True, help="the batch file (JSON lines)")
    b.add_argument("-o", "--output-file", required=True, help="results (appended: resumable)")
    b.add_argument(
        "--max-concurrency",
        type=positive_int,
        default=64,
        help="requests in the engine at once (default 64)",
    )
    b.add_argument(
        "--served-model-name", default=None, help="the model name bodies may use (default: MODEL)"
    )
    b.add_argument("--chat-template", default=None, help="a Jinja chat template, or a file")
    b.add_argument("--reasoning-parser", default=None, choices=("qwen3", "deepseek_r1"))
    b.add_argument("--tool-call-parser", default=None, choices=("hermes", "llama3_json"))
    b.add_argument("--enable-auto-tool-choice", action="store_true")
    b.add_argument("--no-progress", action="store_true", help="no progress bar")
    from jaxpaged.engine.process import process_owner_args

    EngineArgs.add_cli_args(p, defaults=process_owner_args())
    return p


def main(
    argv: Sequence[str] | None = None,
    *,
    engine_factory: Callable[[], Any] | None = None,
    prog: str = "jaxpaged run-batch",
) -> int:
    """Runs the batch; exits 0 when every line was written (errors included), 1 when the
    input cannot be read. ``engine_factory`` replaces the engine built from the flags."""
    parser = build_parser(prog)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        parser.error("--enable-auto-tool-choice needs --tool-call-parser")
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request otherwise
    from jaxpaged.cli.serve import _read_chat_template, _served_name, build_engine
    from jaxpaged.serving.batch import resume_point, run_batch
    from jaxpaged.serving.frontend import Frontend, ServingConfig

    try:
        chat_template = _read_chat_template(args.chat_template)
        with open(args.input_file, encoding="utf-8") as f:
            lines = f.readlines()
        done = resume_point(args.output_file)
    except (OSError, ValueError) as e:
        log.error("%s", e)
        return 1
    config = ServingConfig(
        served_model_name=args.served_model_name or _served_name(args.model),
        model_path=args.model or "",
        chat_template=chat_template,
        reasoning_parser=args.reasoning_parser,
        tool_call_parser=args.tool_call_parser,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        responses_store_size=0,
    )
    if engine_factory is None:
        from jaxpaged.engine.async_engine import AsyncEngine

        engine = AsyncEngine(build_engine(args))
    else:
        engine = engine_factory()

    async def run() -> Any:
        from tqdm.auto import tqdm

        frontend = Frontend(config)
        engine.start()
        frontend.attach_engine(engine)
        total = sum(1 for line in lines if line.strip())
        bar = tqdm(total=total, desc="batch", unit="req", disable=args.no_progress)
        try:
            with open(args.output_file, "a", encoding="utf-8") as out:
                return await run_batch(
                    frontend, lines, out, done=done, max_concurrency=args.max_concurrency,
                    on_line=bar.update,
                )  # fmt: skip
        finally:
            bar.close()
            await engine.shutdown()

    counts = asyncio.run(run())
    log.info(
        "batch done: %d completed, %d failed, %d already in %s",
        counts.completed, counts.failed, counts.skipped, args.output_file,
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
