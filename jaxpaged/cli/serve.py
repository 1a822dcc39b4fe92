"""`jaxpaged serve [MODEL] [flags]` (or `python -m jaxpaged.serve`): the gRPC +
OpenAI-compatible HTTP server.

MODEL (positional or --model) is a Hugging Face hub id, a local folder or a .gguf file
(default: the bundled SmolLM2-135M-Instruct). --config FILE.yaml holds flags as a mapping. One process: one engine thread, gRPC and HTTP on one asyncio loop (with
--data-parallel-size N, N engine processes behind that loop).
SIGTERM / SIGINT drain: new requests are refused, in-flight ones may finish for up to
--shutdown-timeout seconds, the rest are aborted; then the process exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from jaxpaged.args import EngineArgs, non_negative_float, parse_size, positive_int
from jaxpaged.cli.config_file import parse_args_with_config

__all__ = ["build_parser", "main", "parse_size", "serving_config_from_args"]

log = logging.getLogger("jaxpaged.serve")


def _port(text: str) -> int:
    v = int(text)
    if not 0 <= v <= 65535:
        raise argparse.ArgumentTypeError(f"port must be in [0, 65535], got {v}")
    return v


LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def build_parser(prog: str = "python -m jaxpaged.serve") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--config",
        metavar="FILE",
        help="a YAML file of flags (keys: flag names; the command line's flags win)",
    )
    s = p.add_argument_group("server")
    s.add_argument(
        "--host", default="127.0.0.1", help="address for HTTP and gRPC (default 127.0.0.1)"
    )
    s.add_argument("--port", type=_port, default=8000, help="HTTP port (default 8000)")
    s.add_argument("--grpc-port", type=_port, default=50051, help="gRPC port (default 50051)")
    s.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="the model's names in the API: the first is the one responses carry, requests "
        "may use any (default: from MODEL)",
    )
    s.add_argument(
        "--chat-template", default=None, help="a Jinja chat template, or a file holding one"
    )
    s.add_argument(
        "--reasoning-parser",
        default=None,
        choices=("qwen3", "deepseek_r1"),
        help="split the <think>...</think> part of chat replies into reasoning_content",
    )
    s.add_argument(
        "--tool-call-parser",
        default=None,
        choices=("hermes", "llama3_json"),
        help="the model's tool-call format, parsed into tool_calls (hermes: Qwen2.5/Qwen3, "
        "<tool_call> blocks; llama3_json: Llama 3.x JSON calls)",
    )
    s.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='allow tool_choice "auto" (the model decides whether to call a tool; needs '
        "--tool-call-parser)",
    )
    s.add_argument(
        "--max-queue-len",
        type=positive_int,
        default=None,
        help="refuse requests (429 / RESOURCE_EXHAUSTED) while this many wait for their first token",
    )
    s.add_argument(
        "--responses-store-size",
        type=int,
        default=1024,
        help="Responses API: stored responses kept in memory, least recently used evicted "
        "first (default 1024; 0 stores none)",
    )
    s.add_argument(
        "--allowed-media-domains",
        nargs="+",
        default=[],
        metavar="HOST",
        help="hosts whose http(s) image URLs chat requests may name, matched exactly "
        "(default: none, fetching is off; data URLs are always taken)",
    )
    s.add_argument(
        "--media-fetch-timeout",
        type=non_negative_float,
        default=10.0,
        help="seconds one image fetch may take in all (default 10)",
    )
    s.add_argument(
        "--shutdown-timeout",
        type=non_negative_float,
        default=30.0,
        help="seconds in-flight requests may run after SIGTERM/SIGINT (default 30)",
    )
    s.add_argument(
        "--api-key",
        default=os.environ.get("JAXPAGED_API_KEY"),
        help="require 'Authorization: Bearer KEY' (HTTP) / authorization metadata (gRPC); "
        "default $JAXPAGED_API_KEY",
    )
    s.add_argument("--log-level", default="info", choices=LOG_LEVELS)
    s.add_argument(
        "--uvicorn-log-level",
        default=None,
        choices=(*LOG_LEVELS, "trace"),
        help="log level of the HTTP server, uvicorn (default: --log-level)",
    )
    s.add_argument(
        "--disable-log-requests",
        action="store_true",
        help="do not log requests; jaxpaged never logs requests' contents, so this changes "
        "nothing (kept so that vLLM command lines run)",
    )
    s.add_argument(
        "--disable-log-stats",
        action="store_true",
        help="no periodic stats lines in the log (vLLM's: throughput, running and waiting "
        "requests, KV cache usage, and SpecDecoding metrics every 10 s while busy)",
    )
    s.add_argument(
        "--enable-weight-updates",
        action="store_true",
        help="serve the gRPC admin call jaxpaged.v1.Admin/UpdateWeights (weights from a "
        "checkpoint path swapped in while serving; off by default)",
    )
    s.add_argument(
        "--allow-runtime-lora-updating",
        action="store_true",
        default=os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").lower() in ("1", "true"),
        help="serve /v1/load_lora_adapter and /v1/unload_lora_adapter (with --enable-lora; "
        "default: on when VLLM_ALLOW_RUNTIME_LORA_UPDATING is true, as vLLM)",
    )
    from jaxpaged.engine.process import process_owner_args

    # the server owns its process: it configures it and keeps compiled programs on disk
    EngineArgs.add_cli_args(p, defaults=process_owner_args())
    d = p.add_argument_group("several hosts (jax.distributed)")
    d.add_argument("--num-processes", type=positive_int, default=1)
    d.add_argument("--process-id", type=int, default=0)
    d.add_argument(
        "--coordinator-address", default=None, help="host:port of process 0 (num_processes > 1)"
    )
    return p


def _read_chat_template(value: str | None) -> str | None:
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{" not in value:
        raise ValueError(f"--chat-template: {value!r} is neither a file nor a Jinja template")
    return value


def _served_name(model: str | None) -> str:
    if model is None:
        return "SmolLM2-135M-Instruct"
    name = os.path.basename(os.path.normpath(model))
    return (
        name[: -len(".gguf")]
        if name.endswith(".gguf")
        else (model if not os.path.exists(model) else name)
    )


def engine_factory_from_args(args: argparse.Namespace) -> Callable[[], Any]:
    """A function that loads the model, warms up and returns an (unstarted) AsyncEngine."""

    def build() -> Any:
        from jaxpaged.distributed import multihost
        from jaxpaged.engine.async_engine import AsyncEngine

        if args.data_parallel_size > 1:  # replica processes behind one client
            from jaxpaged.engine.data_parallel import DataParallelClient

            return DataParallelClient(EngineArgs.from_cli_args(args))
        engine = build_engine(args)
        from jaxpaged.engine.async_pooling import AsyncPoolingEngine
        from jaxpaged.engine.pooling import PoolingEngine

        if isinstance(engine, PoolingEngine):
            return AsyncPoolingEngine(engine)
        if args.num_processes == 1:
            return AsyncEngine(engine)
        # rank 0 broadcasts each step's batch to the other hosts before running it
        leader = multihost.lead(engine)
        return AsyncEngine(engine, on_shutdown=leader.stop)

    return build


def build_engine(args: argparse.Namespace) -> Any:
    """The engine the flags describe: a PoolingEngine for an encoder (``--runner``, else the
    checkpoint's family), else the LLMEngine (every host of a multi-host run builds the same
    one)."""
    from jaxpaged.engine import LLMEngine
    from jaxpaged.engine.pooling import PoolingEngine
    from jaxpaged.engine.runner_choice import choose_runner

    engine_args = EngineArgs.from_cli_args(args)
    if choose_runner(engine_args) == "pooling":  # --runner, else the checkpoint's family
        if args.num_processes != 1:
            raise ValueError("the pooling runner runs on one host (--num-processes 1)")
        engine: Any = PoolingEngine.from_engine_args(engine_args)
    else:
        engine = LLMEngine.from_engine_args(engine_args)
    # Loading and warm-up leave a large heap that every full collection would scan again
    # while serving ($JAXPAGED_STEP_LOG showed a 749 ms collection inside one step under
    # load): what exists now lives as long as the server, so the collector skips it.
    gc.collect()
    gc.freeze()
    return engine


def main(
    argv: Sequence[str] | None = None,
    *,
    engine_factory: Callable[[], Any] | None = None,
    prog: str = "python -m jaxpaged.serve",
) -> int:
    """Parses flags and serves until SIGTERM/SIGINT. `engine_factory` replaces the engine built
    from the flags (for tests and embedding)."""
    parser = build_parser(prog)
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args_with_config(parser, argv)
    engine_args = EngineArgs.from_cli_args(args)
    from jaxpaged.distributed import multihost
    from jaxpaged.engine import configure_process

    try:  # before anything touches a JAX device
        engine_args.cache_config()  # the settings the model does not decide
        engine_args.parallel_config()
        engine_args.process_config()
        if engine_args.configure_process:  # before anything starts JAX
            configure_process(engine_args.gpu_memory_utilization)
        if args.data_parallel_size > 1 and args.num_processes != 1:
            raise ValueError(
                "--data-parallel-size runs its replicas on one host (--num-processes 1); "
                "for replicas on several hosts see docs/scaling.md"
            )
        multihost.check_engine_args(
            num_processes=args.num_processes,
            preemption_mode=engine_args.preemption_mode,
            kv_offloading_size=engine_args.kv_offloading_size,
        )
        multihost.initialize(
            num_processes=args.num_processes,
            process_id=args.process_id,
            coordinator_address=args.coordinator_address,
        )
    except ValueError as e:
        parser.error(str(e))
    import jax

    if args.data_parallel_size > 1:
        from jaxpaged.engine.dp_devices import replica_environments

        try:
            replica_environments(
                args.data_parallel_size,
                args.tensor_parallel_size,
                platform=jax.devices()[0].platform,
                num_devices=jax.device_count(),
                environ=os.environ,
            )
        except ValueError as e:
            parser.error(str(e))
    elif args.tensor_parallel_size > jax.device_count():
        parser.error(
            f"--tensor-parallel-size {args.tensor_parallel_size} exceeds the "
            f"{jax.device_count()} available device(s)"
        )
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        parser.error("--enable-auto-tool-choice needs --tool-call-parser")
    try:
        chat_template = _read_chat_template(args.chat_template)
    except (OSError, ValueError) as e:
        parser.error(str(e))
    logging.basicConfig(
        level=args.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    from jaxpaged.serving.server import serve

    config = serving_config_from_args(args, chat_template)
    if args.process_id != 0:
        # a follower host: same engine, runs whatever rank 0 broadcasts, serves nothing
        logging.getLogger(__name__).info("process %d: following rank 0", args.process_id)
        return multihost.follow(build_engine(args))
    factory = engine_factory or engine_factory_from_args(args)
    try:
        return asyncio.run(
            serve(config, factory, log_level=args.uvicorn_log_level or args.log_level)
        )
    except OSError as e:  # e.g. a port in use
        log.error("%s", e)
        return 1


def serving_config_from_args(args: argparse.Namespace, chat_template: str | None) -> Any:
    """The ServingConfig of parsed `jaxpaged serve` flags (``chat_template``: the template's
    text, read from --chat-template)."""
    from jaxpaged.serving.frontend import ServingConfig

    names = args.served_model_name or [_served_name(args.model)]
    return ServingConfig(
        served_model_name=names[0],
        served_model_aliases=tuple(names[1:]),
        model_path=args.model or "",
        host=args.host,
        port=args.port,
        grpc_port=args.grpc_port,
        max_queue_len=args.max_queue_len,
        api_key=args.api_key or None,
        shutdown_timeout=args.shutdown_timeout,
        chat_template=chat_template,
        enable_weight_updates=args.enable_weight_updates,
        allow_runtime_lora_updating=args.allow_runtime_lora_updating,
        responses_store_size=args.responses_store_size,
        allowed_media_domains=tuple(args.allowed_media_domains),
        media_fetch_timeout=args.media_fetch_timeout,
        reasoning_parser=args.reasoning_parser,
        tool_call_parser=args.tool_call_parser,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        log_stats_interval=0.0 if args.disable_log_stats else 10.0,
    )


if __name__ == "__main__":
    sys.exit(main())
