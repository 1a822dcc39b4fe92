"""The systems bench/throughput.py runs beside jaxpaged: transformers' static and continuous
batching, vLLM (bench/vllm_peer.py) and llama.cpp (bench/llamacpp_peer.py), each returning a
SystemResult of the same fields."""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Sequence
from typing import Any

from common import BenchRequest
from llamacpp_peer import gguf_file, launched_llama_server, run_llama_offline
from vllm_peer import run_offline


@dataclasses.dataclass(kw_only=True)
class SystemResult:
    system: str
    num_requests: int
    useful_tokens: int
    generated_tokens: int  # includes tokens past a request's max_tokens (static batching)
    seconds: float
    load_seconds: float
    warmup_seconds: float = 0.0
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    token_ids: list[list[int]] | None = None  # per request, where the system reports them

    def to_json(self) -> dict[str, Any]:
        out = {**dataclasses.asdict(self), "tok_per_s": self.tok_per_s}
        del out["token_ids"]
        return out

    @property
    def tok_per_s(self) -> float:
        return self.useful_tokens / self.seconds


def check_counts(system: str, produced: Sequence[int], work: Sequence[BenchRequest]) -> None:
    bad = [(i, n, r.max_tokens) for i, (n, r) in enumerate(zip(produced, work, strict=True))
           if n != r.max_tokens]  # fmt: skip
    if bad:
        i, n, want = bad[0]
        raise RuntimeError(
            f"{system}: {len(bad)} request(s) produced the wrong number of tokens "
            f"(request {i}: {n}, wanted {want})"
        )


# ----------------------------------------------------------------------------- jaxpaged
def _torch_dtype(name: str | None) -> Any:
    import torch

    return {None: torch.float32, "float32": torch.float32, "bfloat16": torch.bfloat16,
            "float16": torch.float16}[name]  # fmt: skip


def _load_hf(folder: str, dtype: str | None) -> tuple[Any, float]:
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=_torch_dtype(dtype))
    model.eval()
    return model, time.perf_counter() - t0


def _pad_id(model: Any, tokenizer: Any) -> int:
    for cand in (tokenizer.pad_token_id, model.generation_config.pad_token_id,
                 tokenizer.eos_token_id, 0):  # fmt: skip
        if isinstance(cand, int):
            return cand
    return 0


def run_hf_static(
    args: argparse.Namespace, work: list[BenchRequest], folder: str, tokenizer: Any
) -> SystemResult:
    import torch

    model, load_s = _load_hf(folder, args.dtype)
    pad = _pad_id(model, tokenizer)
    produced = []
    generated = 0
    t0 = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(work), args.batch_size):
            chunk = work[i : i + args.batch_size]
            width = max(len(r.prompt_token_ids) for r in chunk)
            ids = torch.full((len(chunk), width), pad, dtype=torch.long)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for j, r in enumerate(chunk):  # left padding
                ids[j, width - len(r.prompt_token_ids) :] = torch.tensor(r.prompt_token_ids)
                mask[j, width - len(r.prompt_token_ids) :] = 1
            new = max(r.max_tokens for r in chunk)
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=new,
                min_new_tokens=new,  # EOS suppressed: every row runs the whole batch length
                pad_token_id=pad,
            )
            got = out.shape[1] - width
            generated += got * len(chunk)
            produced += [min(got, r.max_tokens) for r in chunk]
    seconds = time.perf_counter() - t0
    check_counts("hf-static", produced, work)
    return SystemResult(
        system="hf-static",
        num_requests=len(work),
        useful_tokens=sum(produced),
        generated_tokens=generated,
        seconds=seconds,
        load_seconds=load_s,
        extra={"batch_size": args.batch_size},
    )


def run_hf_cb(
    args: argparse.Namespace, work: list[BenchRequest], folder: str, tokenizer: Any
) -> SystemResult:
    import torch
    from transformers import ContinuousBatchingConfig, GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    model, load_s = _load_hf(folder, args.dtype)
    gen = GenerationConfig(
        do_sample=False,
        max_new_tokens=max(r.max_tokens for r in work),
        eos_token_id=-1,  # -1 disables EOS in transformers' continuous batching
        pad_token_id=_pad_id(model, tokenizer),
    )
    hints = WorkloadHints(
        max_prompt_length=max(len(r.prompt_token_ids) for r in work),
        max_generated_length=max(r.max_tokens for r in work),
        num_requests=len(work),
    )
    # Sized for every request at once: left to itself transformers takes 90 % of the free
    # memory for its cache (13 GB on a 24 GB machine, where the OOM killer stopped the run).
    page = ContinuousBatchingConfig().page_size
    cb_config = ContinuousBatchingConfig(
        num_blocks=sum(-(-(len(r.prompt_token_ids) + r.max_tokens) // page) for r in work) + 1
    )
    with torch.inference_mode():
        t0 = time.perf_counter()
        manager = model.init_continuous_batching(
            generation_config=gen, continuous_batching_config=cb_config, workload_hints=hints
        )
        if args.hf_cb_warmup:
            manager.warmup()
        warm = time.perf_counter() - t0
        manager.start()
        try:
            t0 = time.perf_counter()
            rids = [f"bench-{i}" for i in range(len(work))]
            for rid, r in zip(rids, work, strict=True):
                manager.add_request(list(r.prompt_token_ids), request_id=rid,
                                    max_new_tokens=r.max_tokens, eos_token_id=-1)  # fmt: skip
            results: dict[str, Any] = {}
            while len(results) < len(work):
                res = manager.get_result(timeout=1)
                if res is None:
                    if not manager.is_running():
                        raise RuntimeError("hf-cb: the generation thread died")
                    continue
                if res.is_finished():
                    if res.error:
                        raise RuntimeError(f"hf-cb: request {res.request_id}: {res.error}")
                    results[res.request_id] = res
            seconds = time.perf_counter() - t0
        finally:
            manager.stop(block=True, timeout=10)
    produced = [len(results[rid].generated_tokens) for rid in rids]
    check_counts("hf-cb", produced, work)
    return SystemResult(
        system="hf-cb",
        num_requests=len(work),
        useful_tokens=sum(produced),
        generated_tokens=sum(produced),
        seconds=seconds,
        load_seconds=load_s,
        warmup_seconds=warm,
    )


# ---------------------------------------------------------------------------------- vLLM
def run_vllm(args: argparse.Namespace, work: list[BenchRequest], folder: str) -> SystemResult:
    run = run_offline(args.vllm_python, work, model=folder, dtype=args.dtype,
                      max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                      log_path=args.vllm_log)  # fmt: skip
    produced = [len(t) for t in run.token_ids]
    check_counts("vllm", produced, work)
    return SystemResult(
        system="vllm",
        num_requests=len(work),
        useful_tokens=sum(produced),
        generated_tokens=sum(produced),
        seconds=run.seconds,
        load_seconds=run.load_seconds,
        warmup_seconds=run.warmup_seconds,
        extra={"version": run.version},
        token_ids=run.token_ids,
    )


# ---------------------------------------------------------------------------- llama.cpp
def run_llama_cpp(args: argparse.Namespace, work: list[BenchRequest]) -> SystemResult:
    model = gguf_file(args.model)
    parallel = min(len(work), args.max_num_seqs)
    t0 = time.perf_counter()
    with launched_llama_server(args.llama_cpp_server, model=model, host="127.0.0.1",
                               parallel=parallel, ctx_per_slot=args.max_model_len or 2048,
                               threads=args.llama_cpp_threads,
                               log_path=args.llama_cpp_log) as port:  # fmt: skip
        load_s = time.perf_counter() - t0
        run = run_llama_offline(port, "127.0.0.1", work, parallel=parallel)
    check_counts("llama.cpp", run.token_counts, work)
    return SystemResult(
        system="llama.cpp",
        num_requests=len(work),
        useful_tokens=sum(run.token_counts),
        generated_tokens=sum(run.token_counts),
        seconds=run.seconds,
        load_seconds=load_s,
        extra={"parallel": parallel, "threads": args.llama_cpp_threads},
    )
