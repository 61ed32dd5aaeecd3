"""Structured output on the real models: how often the answer validates against its JSON Schema, constrained (a
grammar on every token) and unconstrained (the schema only described in the prompt), on the same prompts, and what
the grammar costs per token.

    python benchmarks/structured_output.py smollm2:135m gemma3:270m --per-schema 19 --free-per-schema 5

Eleven schemas (nested objects, arrays, enums, bounded numbers, required and optional fields, string patterns,
``anyOf``, ``$ref``), each asked about ``--per-schema`` subjects; requests run batched (``--batch`` rows per decode
step, each row its own grammar), greedy. Validation is the ``jsonschema`` package's. Not a test of speed: the
per-token figures are for comparing constrained with unconstrained decoding in the same run.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass

_S = {"type": "string", "maxLength": 40}
_NUM = {"type": "number", "minimum": -1000, "maximum": 1000}


def _obj(props: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": props, "required": list(props) if required is None else required,
            "additionalProperties": False}


#: (name, what to ask for, schema)
SCHEMAS: list[tuple[str, str, dict]] = [
    ("person", "a person related to", _obj({"name": _S, "age": {"type": "integer", "minimum": 0, "maximum": 120}})),
    ("place", "a city related to", _obj({"name": _S, "country": _S, "population": {"type": "integer", "minimum": 0}},
                                        ["name", "country"])),
    ("book", "a book about", _obj({"title": _S, "year": {"type": "integer", "minimum": 1000, "maximum": 2100},
                                   "genres": {"type": "array", "maxItems": 3,
                                              "items": {"enum": ["fiction", "history", "science", "poetry"]}}})),
    ("colour", "the colour of", _obj({"colour": {"enum": ["red", "green", "blue", "yellow", "other"]},
                                      "confidence": {"type": "number", "minimum": 0, "maximum": 1}})),
    ("address", "an address near", _obj({"name": _S, "address": _obj({
        "street": _S, "city": _S, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}})})),
    ("shopping", "a shopping list for", _obj({"items": {"type": "array", "minItems": 1, "maxItems": 3, "items": _obj({
        "name": _S, "qty": {"type": "integer", "minimum": 1, "maximum": 99}})}})),
    ("yes_no", "a yes/no judgement on whether people like", _obj({"answer": {"type": "boolean"}, "reason": _S},
                                                                  ["answer"])),
    ("event", "a dated event about", _obj({"event": _S, "date": {"type": "string",
                                                                   "pattern": "^[12][0-9]{3}-[01][0-9]-[0-3][0-9]$"}})),
    ("shape", "a shape that reminds you of", _obj({"shape": {"anyOf": [
        _obj({"kind": {"const": "circle"}, "radius": {"type": "number", "minimum": 0, "maximum": 100}}),
        _obj({"kind": {"const": "square"}, "side": {"type": "number", "minimum": 0, "maximum": 100}})]}})),
    ("segment", "a line segment for a drawing of", {
        "$defs": {"point": _obj({"x": _NUM, "y": _NUM})}, "type": "object", "additionalProperties": False,
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"]}),
    ("tags", "three tags for", {"type": "array", "minItems": 2, "maxItems": 4,
                                "items": {"type": "string", "maxLength": 20}}),
]

SUBJECTS = ["the sea", "music", "bread", "mountains", "trains", "owls", "a library", "winter", "coffee", "chess",
            "gardens", "the moon", "bicycles", "rain", "clocks", "bridges", "cheese", "football", "glass", "maps",
            "honey", "volcanoes", "paper", "islands", "lanterns"]


def prompts(schema_name: str, per_schema: int) -> list[str]:
    what, schema = next((w, s) for n, w, s in SCHEMAS if n == schema_name)
    return [f"Give {what} {subject}. Answer with JSON only, matching this JSON schema: {json.dumps(schema)}"
            for subject in SUBJECTS[:per_schema]]


@dataclass
class Outcome:
    schema: str
    text: str
    valid: bool
    tokens: int


def validates(text: str, schema: dict) -> bool:
    import jsonschema

    body = text.strip().removeprefix("```json").removeprefix("```").removesuffix("```").strip()
    try:
        jsonschema.validate(json.loads(body), schema)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def run(model, per_schema: int, *, constrained: bool, batch: int = 8, max_tokens: int = 160,
        schemas: list[str] | None = None) -> tuple[list[Outcome], float]:
    """Generate for every (schema, subject); returns the outcomes and the decode tokens per second overall.
    ``model`` is an ``mlx_engine.Model`` loaded with ``max_sequences >= batch``."""
    from mlx_engine.api import GenerationOptions

    jobs = []
    for name, _, schema in SCHEMAS:
        if schemas is None or name in schemas:
            opts = GenerationOptions.parse({"max_tokens": max_tokens, **({"json_schema": schema} if constrained
                                                                           else {})})
            for p in prompts(name, per_schema):
                jobs.append((name, schema, opts, model.prompt_tokens(p)))
    out: list[Outcome] = []
    tokens = 0
    start = time.perf_counter()
    eos = model.tokenizer.eos_ids
    for i in range(0, len(jobs), batch):
        group = jobs[i:i + batch]
        model.runner.reset()
        reqs = [opts.request(toks, sequence=k) for k, (_, _, opts, toks) in enumerate(group)]
        with model._lock:
            ids = model.runner.generate_batch(reqs)
        for (name, schema, _, _), row in zip(group, ids):
            text = model.tokenizer.decode([t for t in row if t not in eos])
            out.append(Outcome(name, text, validates(text, schema), len(row)))
            tokens += len(row)
    model.runner.reset()
    return out, tokens / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="*", default=["smollm2:135m", "gemma3:270m"])
    ap.add_argument("--per-schema", type=int, default=20)
    ap.add_argument("--free-per-schema", type=int, default=None,
                    help="subjects per schema for the unconstrained runs (default: --per-schema; they run to "
                         "max_tokens far more often, so they take longer)")
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args()
    from mlx_engine.api import Model
    from mlx_engine.store import Store

    for name in args.models:
        resolved = Store().resolve(name)
        model = Model(resolved.name, resolved.path, max_sequences=args.batch, context_length=1024)
        free, free_tps = run(model, args.free_per_schema or args.per_schema, constrained=False, batch=args.batch)
        held, held_tps = run(model, args.per_schema, constrained=True, batch=args.batch)
        print(f"\n{name}: {len(held)} constrained and {len(free)} unconstrained generations over {len(SCHEMAS)} "
              "schemas (the unconstrained ones on the first subjects of the same prompts)")
        print(f"{'schema':10} {'unconstrained valid':>20} {'constrained valid':>18}")
        for schema, _, _ in SCHEMAS:
            f = [o for o in free if o.schema == schema]
            h = [o for o in held if o.schema == schema]
            print(f"{schema:10} {sum(o.valid for o in f):>14} / {len(f):<3} {sum(o.valid for o in h):>12} / {len(h)}")
        print(f"{'all':10} {sum(o.valid for o in free):>14} / {len(free):<3} {sum(o.valid for o in held):>12} / "
              f"{len(held)}")
        print(f"decode tokens/s (batched {args.batch}): unconstrained {free_tps:.1f}, constrained {held_tps:.1f} "
              f"(ratio {held_tps / free_tps:.2f})")
        bad = [o for o in held if not o.valid]
        for o in bad[:5]:
            print("  invalid constrained output:", o.schema, repr(o.text[:200]))
        model.close()


if __name__ == "__main__":
    main()
