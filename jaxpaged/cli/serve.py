"""`python -m jaxpaged.serve [MODEL] [flags]`: the gRPC + OpenAI-compatible HTTP server.

MODEL is a Hugging Face hub id, a local folder or a .gguf file (default: the bundled
SmolLM2-135M-Instruct). One process: one engine thread, gRPC and HTTP on one asyncio loop.
SIGTERM / SIGINT drain: new requests are refused, in-flight ones may finish for up to
--shutdown-timeout seconds, the rest are aborted; then the process exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["build_parser", "main", "parse_size"]

log = logging.getLogger("jaxpaged.serve")

_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}  # fmt: skip


def parse_size(text: str) -> int:
    """Bytes from '4294967296', '4GiB', '512MiB', '1.5G' (argparse type)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 4GiB, 512MiB, 1000000)")
    value = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be > 0, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def _non_negative_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not v >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return v


def _port(text: str) -> int:
    v = int(text)
    if not 0 <= v <= 65535:
        raise argparse.ArgumentTypeError(f"port must be in [0, 65535], got {v}")
    return v


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m jaxpaged.serve",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "model",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="HF hub id, local folder or .gguf file (default: bundled SmolLM2)",
    )
    s = p.add_argument_group("server")
    s.add_argument(
        "--host", default="127.0.0.1", help="address for HTTP and gRPC (default 127.0.0.1)"
    )
    s.add_argument("--port", type=_port, default=8000, help="HTTP port (default 8000)")
    s.add_argument("--grpc-port", type=_port, default=50051, help="gRPC port (default 50051)")
    s.add_argument(
        "--served-model-name", default=None, help="model name clients use (default: from MODEL)"
    )
    s.add_argument(
        "--chat-template", default=None, help="a Jinja chat template, or a file holding one"
    )
    s.add_argument(
        "--max-queue-len",
        type=_positive_int,
        default=None,
        help="refuse requests (429 / RESOURCE_EXHAUSTED) while this many wait for their first token",
    )
    s.add_argument(
        "--shutdown-timeout",
        type=_non_negative_float,
        default=30.0,
        help="seconds in-flight requests may run after SIGTERM/SIGINT (default 30)",
    )
    s.add_argument(
        "--api-key",
        default=os.environ.get("JAXPAGED_API_KEY"),
        help="require 'Authorization: Bearer KEY' (HTTP) / authorization metadata (gRPC); "
        "default $JAXPAGED_API_KEY",
    )
    s.add_argument(
        "--log-level", default="info", choices=("debug", "info", "warning", "error", "critical")
    )
    e = p.add_argument_group("engine")
    e.add_argument("--dtype", default=None, choices=("auto", "float32", "bfloat16", "float16"))
    e.add_argument("--max-model-len", type=_positive_int, default=None)
    e.add_argument("--max-num-seqs", type=_positive_int, default=64)
    e.add_argument("--max-num-batched-tokens", type=_positive_int, default=None)
    e.add_argument("--block-size", type=_positive_int, default=16)
    e.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    e.add_argument(
        "--kv-cache-memory",
        type=parse_size,
        default=None,
        help="bytes for the KV cache (CPU; e.g. 2GiB)",
    )
    e.add_argument(
        "--num-kv-blocks",
        type=_positive_int,
        default=None,
        help="exact KV block count (overrides memory sizing)",
    )
    e.add_argument(
        "--swap-space",
        type=_non_negative_float,
        default=4.0,
        help="GiB of host memory for swapped blocks",
    )
    e.add_argument("--preemption-mode", choices=("recompute", "swap"), default="recompute")
    e.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    e.add_argument(
        "--enforce-eager", action="store_true", help="skip warm-up; compile shapes on first use"
    )
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("-tp", "--tensor-parallel-size", type=_positive_int, default=1)
    d = p.add_argument_group("several hosts (jax.distributed)")
    d.add_argument("--num-processes", type=_positive_int, default=1)
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

        engine = build_engine(args)
        if args.num_processes == 1:
            return AsyncEngine(engine)
        # rank 0 broadcasts each step's batch to the other hosts before running it
        leader = multihost.lead(engine)
        return AsyncEngine(engine, on_shutdown=leader.stop)

    return build


def build_engine(args: argparse.Namespace) -> Any:
    """The LLMEngine the flags describe (every host of a multi-host run builds the same one)."""
    from jaxpaged.engine import LLMEngine

    return LLMEngine.from_args(
        args.model,
        dtype=None if args.dtype in (None, "auto") else args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_memory=args.kv_cache_memory,
        num_kv_blocks=args.num_kv_blocks,
        swap_space=args.swap_space,
        preemption_mode=args.preemption_mode,
        enable_prefix_caching=args.enable_prefix_caching,
        enforce_eager=args.enforce_eager,
        seed=args.seed,
        tensor_parallel_size=args.tensor_parallel_size,
    )


def main(
    argv: Sequence[str] | None = None, *, engine_factory: Callable[[], Any] | None = None
) -> int:
    """Parses flags and serves until SIGTERM/SIGINT. `engine_factory` replaces the engine built
    from the flags (for tests and embedding)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    from jaxpaged.distributed import multihost

    if not 0 < args.gpu_memory_utilization <= 1:
        parser.error(
            f"--gpu-memory-utilization must be in (0, 1], got {args.gpu_memory_utilization}"
        )
    from jaxpaged.engine import configure_process

    configure_process(args.gpu_memory_utilization)  # before anything starts JAX
    try:  # before anything touches a JAX device
        multihost.check_engine_args(
            num_processes=args.num_processes, preemption_mode=args.preemption_mode
        )
        multihost.initialize(
            num_processes=args.num_processes,
            process_id=args.process_id,
            coordinator_address=args.coordinator_address,
        )
    except ValueError as e:
        parser.error(str(e))
    import jax

    if args.tensor_parallel_size > jax.device_count():
        parser.error(
            f"--tensor-parallel-size {args.tensor_parallel_size} exceeds the "
            f"{jax.device_count()} available device(s)"
        )
    try:
        chat_template = _read_chat_template(args.chat_template)
    except (OSError, ValueError) as e:
        parser.error(str(e))
    logging.basicConfig(
        level=args.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    from jaxpaged.serving.frontend import ServingConfig
    from jaxpaged.serving.server import serve

    config = ServingConfig(
        served_model_name=args.served_model_name or _served_name(args.model),
        model_path=args.model or "",
        host=args.host,
        port=args.port,
        grpc_port=args.grpc_port,
        max_queue_len=args.max_queue_len,
        api_key=args.api_key or None,
        shutdown_timeout=args.shutdown_timeout,
        chat_template=chat_template,
    )
    if args.process_id != 0:
        # a follower host: same engine, runs whatever rank 0 broadcasts, serves nothing
        logging.getLogger(__name__).info("process %d: following rank 0", args.process_id)
        return multihost.follow(build_engine(args))
    factory = engine_factory or engine_factory_from_args(args)
    try:
        return asyncio.run(serve(config, factory, log_level=args.log_level))
    except OSError as e:  # e.g. a port in use
        log.error("%s", e)
        return 1


if __name__ == "__main__":
    sys.exit(main())
