"""One process of the two-process multi-host test (run by test_multihost.py, not by pytest).

argv: MODEL_DIR PROCESS_ID COORDINATOR_ADDRESS OUT_JSON TP. Every process builds the same
engine on the global mesh; rank 0 generates and writes its outputs, rank 1 follows.
"""

from __future__ import annotations

import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
os.environ["JAX_PLATFORMS"] = "cpu"


def main() -> None:
    model, rank, address, out_path, tp = sys.argv[1:6]
    from jaxpaged.distributed import multihost

    multihost.initialize(num_processes=2, process_id=int(rank), coordinator_address=address)
    import jax
    from tp_cases import ENGINE_ARGS, MAX_TOKENS, PROMPTS

    from jaxpaged import LLM, SamplingParams

    llm = LLM(model, tensor_parallel_size=int(tp), show_progress=False, **ENGINE_ARGS)
    if jax.process_index() == 0:
        leader = multihost.lead(llm.engine)
        outs = llm.generate(
            PROMPTS,
            SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
            use_tqdm=False,
        )
        metrics = llm.get_metrics()
        leader.stop()
        pool = llm.engine.runner.pool[0]
        result = {
            "tokens": [list(o.outputs[0].token_ids) for o in outs],
            "num_compilations_after_warmup": metrics["num_compilations_after_warmup"],
            "device_count": jax.device_count(),
            "local_device_count": jax.local_device_count(),
            "pool_shape": list(pool.shape),
            "pool_local_shards": [list(s.data.shape) for s in pool.addressable_shards],
        }
        with open(out_path, "w") as f:
            json.dump(result, f)
    else:
        steps = multihost.follow(llm.engine)
        with open(out_path, "w") as f:
            json.dump({"follower_steps": steps}, f)


if __name__ == "__main__":
    main()
