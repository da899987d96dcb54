"""Which grammar library enforces JSON schemas in the sampler: llguidance against outlines-core, measured.

For a tokenizer (SmolLM2's 49k vocabulary, or the tiny model's), per library: the one-off cost of wrapping the
tokenizer, the cost of compiling a schema (the request's latency before its first token), and the cost of one
token's mask along a valid JSON document (what every constrained decode step adds). Also whether each compiles
the schema constructs agents send (`$ref`, `anyOf`, `pattern`, `format`...). xgrammar was not measured: its
wheel pulls triton and apache-tvm-ffi into a CPU-only venv.

    PYTHONPATH=$PWD python bench/grammar_choice.py [--model smollm2|tiny]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

SCHEMAS = {
    "flat": {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                              "ok": {"type": "boolean"}}, "required": ["name", "age", "ok"],
             "additionalProperties": False},
    "nested+ref": {"type": "object", "$defs": {"item": {"type": "object", "properties": {
        "label": {"type": "string"}, "score": {"type": "number"}}, "required": ["label", "score"]}},
        "properties": {"items": {"type": "array", "items": {"$ref": "#/$defs/item"}}, "note": {"anyOf": [
            {"type": "string"}, {"type": "null"}]}}, "required": ["items", "note"]},
    "enum+pattern": {"type": "object", "properties": {"kind": {"enum": ["a", "b", "c"]},
                                                      "code": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"}},
                     "required": ["kind", "code"]},
}
DOCUMENTS = {"flat": {"name": "Ada", "age": 36, "ok": True},
             "nested+ref": {"items": [{"label": "x", "score": 1.5}, {"label": "y", "score": 2}], "note": None},
             "enum+pattern": {"kind": "b", "code": "ABC12"}}


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def llguidance_run(tokenizer, schema: dict, document: str) -> tuple[float, float, float]:
    import llguidance
    import llguidance.hf

    started = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tokenizer)
    wrap = time.perf_counter() - started
    started = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
    matcher = llguidance.LLMatcher(lltok, grammar)
    assert not matcher.is_error(), matcher.get_error()
    compile_s = time.perf_counter() - started
    steps = []
    for token in tokenizer.encode(document, add_special_tokens=False):
        started = time.perf_counter()
        matcher.compute_bitmask()
        steps.append(time.perf_counter() - started)
        assert matcher.consume_token(token), matcher.get_error()
    return wrap, compile_s, statistics.median(steps)


def outlines_run(tokenizer, schema: dict, document: str) -> tuple[float, float, float]:
    import outlines_core

    started = time.perf_counter()
    vocab: dict[str, list[int]] = {}
    eos = tokenizer.eos_token_id
    for token, i in tokenizer.get_vocab().items():
        if i != eos:
            vocab.setdefault(token, []).append(i)
    vocabulary = outlines_core.Vocabulary(eos, vocab)
    wrap = time.perf_counter() - started
    started = time.perf_counter()
    regex = outlines_core.json_schema.build_regex_from_schema(json.dumps(schema))
    index = outlines_core.Index(regex, vocabulary)
    guide = outlines_core.Guide(index)
    compile_s = time.perf_counter() - started
    steps = []
    for token in tokenizer.encode(document, add_special_tokens=False):
        started = time.perf_counter()
        guide.get_tokens()
        steps.append(time.perf_counter() - started)
        guide.advance(token)
    return wrap, compile_s, statistics.median(steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from tinkerless.functions.models import build_tiny_model, resolve_model

    path = build_tiny_model(tempfile.mkdtemp() + "/tiny", hidden_size=64, num_layers=2, seed=0) \
        if args.model == "tiny" else resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    print(f"tokenizer of {args.model}: {len(tokenizer)} tokens")
    for name, schema in SCHEMAS.items():
        document = json.dumps(DOCUMENTS[name], separators=(",", ":"))
        for library, run in (("llguidance", llguidance_run), ("outlines-core", outlines_run)):
            try:
                wrap, compile_s, step = run(tokenizer, schema, document)
            except Exception as exc:  # noqa: BLE001 - a library that cannot compile the schema says so
                print(f"  {name:13s} {library:13s} FAILED: {type(exc).__name__}: {str(exc)[:120]}")
                continue
            print(f"  {name:13s} {library:13s} tokenizer {ms(wrap):>11s}  compile {ms(compile_s):>11s}  "
                  f"mask/token {ms(step):>9s}")


if __name__ == "__main__":
    main()
