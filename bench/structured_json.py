"""How often structured JSON output closes: the schemas of ``bench/data/json_schemas.json``
(nested objects, arrays, enums, numbers, booleans, strings with and without ``maxLength``)
on the bundled model, strict (the default) and permissive (``strict=False``), at temperature
0 and 0.9 (``--seeds`` samples each), counting the outputs that finish within
``--max-tokens`` tokens as JSON that validates against the schema.

    python bench/structured_json.py [--max-tokens 200] [--seeds 3] [--model PATH]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

SCHEMAS = Path(__file__).parent / "data" / "json_schemas.json"


def conversation(subject: str) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": "You reply with JSON only."},
        {"role": "user", "content": f"Give me an example of {subject} as JSON."},
    ]


def closes(text: str, finish: str | None, schema: dict) -> bool:
    """The output finished on its own and is JSON that validates against the schema."""
    import jsonschema

    if finish != "stop":
        return False
    try:
        jsonschema.validate(json.loads(text), schema)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--model", default=None)
    args = parser.parse_args()

    from jaxpaged import LLM, SamplingParams
    from jaxpaged.models import default_model_path
    from jaxpaged.sampling_params import StructuredOutput

    cases = json.loads(SCHEMAS.read_text())
    llm = LLM(args.model or default_model_path(), max_model_len=512, max_num_seqs=32)
    print(
        f"{len(cases)} schemas ({sum(c['bounded'] for c in cases)} with bounded strings), "
        f"max_tokens {args.max_tokens}"
    )
    print("| reading | temperature | bounded strings | unbounded strings | mean tokens |")
    print("|---|---|---|---|---|")
    for strict in (True, False):
        for temperature, seeds in ((0.0, [None]), (0.9, list(range(args.seeds)))):
            jobs = [(c, s) for c in cases for s in seeds]
            params = [
                SamplingParams(
                    temperature=temperature, seed=s, max_tokens=args.max_tokens,
                    structured_output=StructuredOutput(json=c["schema"], strict=strict),
                )
                for c, s in jobs
            ]  # fmt: skip
            outs = llm.chat([conversation(c["subject"]) for c, _ in jobs], params, use_tqdm=False)
            ok = {True: [0, 0], False: [0, 0]}  # bounded -> [closed, total]
            tokens = 0
            for (c, _), out in zip(jobs, outs, strict=True):
                o = out.outputs[0]
                ok[c["bounded"]][0] += closes(o.text, o.finish_reason, c["schema"])
                ok[c["bounded"]][1] += 1
                tokens += len(o.token_ids)
            print(
                f"| {'strict' if strict else 'permissive'} | {temperature} | "
                f"{ok[True][0]}/{ok[True][1]} | {ok[False][0]}/{ok[False][1]} | "
                f"{tokens / len(jobs):.0f} |"
            )


if __name__ == "__main__":
    main()
