"""`python -m jaxpaged.generate [--model M] [--max-tokens N] [--temperature T] [--chat] PROMPT`

prints only the generated text on stdout (logs go to stderr), from the paged engine."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from jaxpaged.engine import Prompt, process_owner_args
from jaxpaged.llm import LLM
from jaxpaged.sampling_params import SamplingParams


def _parse_args(argv: Sequence[str] | None, prog: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=prog, description=__doc__)
    p.add_argument("prompt", metavar="PROMPT")
    p.add_argument(
        "--model",
        default=None,
        help="local folder, HF hub id or .gguf file (default: the bundled SmolLM2)",
    )
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None)
    p.add_argument("--max-model-len", type=int, default=2048)
    args = p.parse_args(argv)
    if args.max_tokens < 1:
        p.error(f"--max-tokens must be >= 1, got {args.max_tokens}")
    if args.temperature < 0:
        p.error(f"--temperature must be >= 0, got {args.temperature}")
    return args


def main(argv: Sequence[str] | None = None, prog: str = "python -m jaxpaged.generate") -> int:
    args = _parse_args(argv, prog)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    # One prompt: compile only the shapes it uses instead of warming every bucket. The command
    # owns its process: it configures it and keeps compiled programs on disk.
    llm = LLM(
        args.model,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=8,
        enforce_eager=True,
        seed=args.seed or 0,
        **process_owner_args(),
    )
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        max_tokens=min(args.max_tokens, args.max_model_len - 1),
    )
    if args.chat:
        prompt: Prompt = llm.apply_chat_template([{"role": "user", "content": args.prompt}])
    else:
        prompt = args.prompt
    try:
        (out,) = llm.generate(prompt, params, use_tqdm=False)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(out.outputs[0].text + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
