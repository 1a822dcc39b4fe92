"""Structured output on the host: the scheduler keeps a grammar request off the overlapped
path (never planned with a token in flight) while other requests keep overlapping, and the
llguidance grammars on the bundled tokenizer (masks, cache, invalid grammars)."""

from __future__ import annotations

import numpy as np
import pytest
from fake_runner import reference_output, run
from test_scheduler import assert_all_free, make, make_request

from jaxpaged.sampling_params import SamplingParams, StructuredOutput

REGEX = StructuredOutput(regex="[0-9]+")


def test_grammar_requests_wait_for_their_token_while_others_overlap():
    """Overlapped, a plain request feeds every decode from the device (prev_row); a grammar
    request is planned only once the host has its previous token (so its matcher can make the
    next mask): every other step. Both produce the reference's tokens."""
    sched, runner = make()
    prompt = [2, 7, 1, 8]
    sched.add_request(make_request("plain", prompt, max_tokens=6))
    sched.add_request(make_request("g", prompt, max_tokens=6, structured_output=REGEX))
    plans = []
    done = run(sched, runner, overlap=True, on_step=lambda plan, ups: plans.append(plan))
    assert done == {"plain": reference_output(prompt, 6), "g": reference_output(prompt, 6)}
    plain = [i for i, p in enumerate(plans) for s in p.seqs if s.request_id == "plain"]
    grammar = [(i, s) for i, p in enumerate(plans) for s in p.seqs if s.request_id == "g"]
    assert plain == list(range(6))  # one step each, back to back
    # while the plain request keeps the steps coming: every other step (an empty plan after
    # it ends lets the host catch up at once)
    assert [i for i, _ in grammar][:3] == [0, 2, 4] and len(grammar) == 6
    assert all(s.prev_row == -1 for _, s in grammar)  # fed from the host's tokens
    assert_all_free(sched)


def test_structured_output_validation():
    so = StructuredOutput(json={"type": "object", "properties": {"b": {}, "a": {}}})
    assert so.json == '{"type": "object", "properties": {"b": {}, "a": {}}}'  # order kept
    assert SamplingParams(structured_output={"choice": ["x", "y"]}).structured_output == (
        StructuredOutput(choice=("x", "y"))
    )
    for bad, match in [
        ({}, "exactly one"),
        ({"regex": "a", "choice": ["a"]}, "exactly one"),
        ({"choice": []}, "at least one"),
        ({"regex": ""}, "non-empty"),
        ({"json_object": False}, "exactly one"),
    ]:
        with pytest.raises(ValueError, match=match):
            StructuredOutput(**bad)


@pytest.fixture(scope="module")
def compiler(bundled_model_path):
    transformers = pytest.importorskip("transformers")
    from jaxpaged.worker.grammar import GrammarCompiler

    tokenizer = transformers.AutoTokenizer.from_pretrained(bundled_model_path)
    return GrammarCompiler(tokenizer, 49152, eos_token_ids=[2]), tokenizer


def _allowed(mask_row: np.ndarray) -> np.ndarray:  # int32 [W] -> token ids allowed
    bits = (mask_row.view(np.uint32)[:, None] >> np.arange(32, dtype=np.uint32)) & 1
    return np.flatnonzero(bits.reshape(-1))


def test_choice_masks_allow_exactly_the_prefixes_then_end(compiler):
    """Each allowed token continues one of the choices (checked on the token's text), the
    whole-word tokens are among them, and a complete choice ends the grammar."""
    from jaxpaged.worker.grammar import GrammarMatchers

    comp, tok = compiler
    matchers = GrammarMatchers(comp)
    matchers.add("r", StructuredOutput(choice=["yes", "no way"]))
    first = _allowed(matchers.masks(["r"])[0])
    texts = [tok.decode([int(t)]) for t in first]
    assert all(t and ("yes".startswith(t) or "no way".startswith(t)) for t in texts), texts
    (yes,) = tok.encode("yes", add_special_tokens=False)
    assert yes in first
    assert not matchers.accept("r", yes)  # a complete choice: the grammar has ended
    no, way = tok.encode("no way", add_special_tokens=False)
    matchers.add("s", StructuredOutput(choice=["yes", "no way"]))
    assert matchers.accept("s", no)
    assert list(_allowed(matchers.masks(["s"])[0])) == [way]
    assert not matchers.accept("s", way)
    matchers.retain(["s"])
    assert "r" not in matchers and len(matchers) == 1


def test_masks_through_drafts(compiler):
    """Speculative decoding: the mask after each draft is the mask after consuming it; after
    a draft the grammar rejects every token is allowed (nothing there is emitted); the
    request's own matcher is untouched."""
    from jaxpaged.worker.grammar import GrammarMatchers

    comp, tok = compiler
    matchers = GrammarMatchers(comp)
    matchers.add("r", StructuredOutput(choice=["yes", "no way"]))
    no, way = tok.encode("no way", add_special_tokens=False)
    (yes,) = tok.encode("yes", add_special_tokens=False)
    masks = matchers.masks_through("r", [no, yes, way])  # "yes" cannot follow "no"
    assert masks.shape == (4, matchers.masks(["r"]).shape[1])
    np.testing.assert_array_equal(masks[0], matchers.masks(["r"])[0])
    assert list(_allowed(masks[1])) == [way]
    assert (masks[2:] == -1).all()
    assert list(_allowed(matchers.masks_through("r", [no, way])[2])) == [2]  # ended: EOS only
    assert matchers.accept("r", no)  # the request's matcher had not moved
    assert list(_allowed(matchers.masks(["r"])[0])) == [way]


def test_grammars_are_cached_and_invalid_ones_named(compiler):
    comp, _ = compiler
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    before = comp.num_compiled
    comp.grammar(StructuredOutput(json=schema))
    comp.grammar(StructuredOutput(json=dict(schema)))  # an equal schema: the cache
    assert comp.num_compiled == before + 1
    for bad in [
        StructuredOutput(json={"type": "objekt"}),
        StructuredOutput(json='{"type": '),
        StructuredOutput(regex="[a-"),
        StructuredOutput(grammar="start: undefined_rule"),
    ]:
        with pytest.raises(ValueError, match=r"^structured_output: invalid grammar"):
            comp.grammar(bad)


def test_batched_masks_equal_one_by_one(compiler):
    """Several rows filled on llguidance's threads give each row's own mask."""
    from jaxpaged.worker.grammar import GrammarMatchers

    comp, tok = compiler
    matchers = GrammarMatchers(comp)
    specs = [StructuredOutput(regex="[0-9]+"), StructuredOutput(choice=["yes", "no way"])]
    specs.append(StructuredOutput(json={"type": "object"}))
    for i, spec in enumerate(specs):
        matchers.add(f"r{i}", spec)
    together = matchers.masks([f"r{i}" for i in range(len(specs))])
    for i in range(len(specs)):
        np.testing.assert_array_equal(together[i], matchers.masks([f"r{i}"])[0])
    assert len({together[i].tobytes() for i in range(len(specs))}) == len(specs)


def test_strict_json_is_closed_and_compact_unless_asked_otherwise(compiler):
    """Strict (the default): an object schema takes only its declared properties (unless it
    allows more, or declares none) and no whitespace between tokens; strict=False is the
    permissive reading. strict is refused where it means nothing (a regex)."""
    comp, tok = compiler
    nested = {"type": "object", "properties": {"b": {"type": "integer"}}}
    schema = {"type": "object", "properties": {"a": nested, "free": {"type": "object"}},
              "required": ["a"]}  # fmt: skip

    def accepts(spec: StructuredOutput, text: str) -> bool:
        m = comp.matcher(spec)
        return all(m.consume_token(t) for t in tok.encode(text, add_special_tokens=False)) and (
            m.is_accepting()
        )

    strict, loose = StructuredOutput(json=schema), StructuredOutput(json=schema, strict=False)
    assert strict.strict and strict != loose
    for text, strict_ok in [
        ('{"a":{"b":1}}', True),
        ('{"a":{"b":1},"free":{"x":[1]}}', True),  # {"type": "object"} stays open
        ('{"a": {"b": 1}}', False),  # whitespace
        ('{\n  "a":{"b":1}}', False),
        ('{"a":{"b":1},"c":2}', False),  # a property the schema does not declare
        ('{"a":{"b":1,"c":2}}', False),  # ... in a nested object
    ]:
        assert accepts(strict, text) is strict_ok, text
        assert accepts(loose, text), text
    opened = {**schema, "additionalProperties": {"type": "integer"}}
    assert accepts(StructuredOutput(json=opened), '{"a":{"b":1},"c":2}')
    assert accepts(StructuredOutput(json_object=True), '{"x":{"y":[1,2]}}')
    assert not accepts(StructuredOutput(json_object=True), '{"x": 1}')
    assert accepts(StructuredOutput(json_object=True, strict=False), '{"x": 1}')
    with pytest.raises(ValueError, match="strict"):
        StructuredOutput(regex="a+", strict=False)


def test_close_schema_closes_declared_objects_everywhere_but_all_of_branches():
    from jaxpaged.worker.json_strict import close_schema

    point = {"type": "object", "properties": {"x": {"type": "number"}}}
    schema = {
        "$defs": {"point": point},
        "anyOf": [point, {"type": "array", "items": point}],
        "allOf": [point, {"properties": {"y": {"type": "number"}}}],
        "properties": {"open": {**point, "patternProperties": {"^z": {}}}},
    }
    closed = close_schema(schema)
    shut = {**point, "additionalProperties": False}
    assert closed["$defs"]["point"] == shut == closed["anyOf"][0] == closed["anyOf"][1]["items"]
    assert closed["allOf"] == schema["allOf"] and closed["additionalProperties"] is False
    assert "additionalProperties" not in closed["properties"]["open"]
    assert "additionalProperties" not in point  # the input is not changed


def test_fast_tokenizer_gives_the_same_masks(compiler, bundled_model_path):
    """The terminal commands' tokenizer (tokenizers alone, jaxpaged.models.fast_tokenizer)
    drives llguidance to the same masks as transformers' tokenizer of the folder."""
    from jaxpaged.models.fast_tokenizer import FastTokenizer
    from jaxpaged.worker.grammar import GrammarCompiler, GrammarMatchers

    fast = GrammarCompiler(FastTokenizer.from_folder(bundled_model_path), 49152, [2])
    spec = StructuredOutput(json={"type": "object", "properties": {"n": {"type": "integer"}}})
    masks = []
    for comp in (compiler[0], fast):
        matchers = GrammarMatchers(comp)
        matchers.add("r", spec)
        rows = [matchers.masks(["r"])[0]]
        for t in compiler[1].encode('{"n":12', add_special_tokens=False):
            assert matchers.accept("r", t)
            rows.append(matchers.masks(["r"])[0])
        masks.append(np.stack(rows))
    np.testing.assert_array_equal(masks[0], masks[1])
