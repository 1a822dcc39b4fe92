"""`python -m jaxpaged.client [--grpc HOST:PORT] PROMPT`: streams a generation from a running
`python -m jaxpaged.serve` to the terminal (the library is `jaxpaged.serving.client`)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

__all__ = ["main"]


def main(argv: Sequence[str] | None = None, prog: str = "python -m jaxpaged.client") -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__)
    p.add_argument("prompt", metavar="PROMPT")
    p.add_argument("--grpc", default="127.0.0.1:50051", metavar="HOST:PORT")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument(
        "--raw", action="store_true", help="send PROMPT as is, without the chat template"
    )
    p.add_argument("--api-key", default=os.environ.get("JAXPAGED_API_KEY"))
    p.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    args = p.parse_args(argv)

    import grpc

    from jaxpaged.serving.client import GenerationClient

    sampling = {"max_tokens": args.max_tokens, "temperature": args.temperature, "seed": args.seed}
    prompt = args.prompt if args.raw else None
    messages = None if args.raw else [{"role": "user", "content": args.prompt}]
    try:
        with GenerationClient(args.grpc, api_key=args.api_key) as client:
            finish = None
            for chunk in client.stream(prompt, messages=messages, timeout=args.timeout, **sampling):
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
                finish = chunk.finish_reason or finish
            sys.stdout.write("\n")
            print(f"[finish_reason: {finish}]", file=sys.stderr)
    except grpc.RpcError as e:
        print(f"\nerror: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # leaving the stream cancels the request on the server
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
