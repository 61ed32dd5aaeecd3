"""Structured output: response formats parsed and checked (loud errors for what the grammar engine rejects), and
generations on both real models that always validate (``jsonschema``), alone, batched with a grammar per row, from
the CLI and through the server's OpenAI and ollama routes (the real clients)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from click.testing import CliRunner

from benchmarks.structured_output import SCHEMAS, run, validates
from mlx_engine.errors import IncompleteOutputError, InvalidRequestError
from mlx_engine.models.text.constraint import ResponseFormat, parse_response_format

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


# ------------------------------------------------------------------------------------------------------ parsing

@pytest.mark.parametrize("value, kind", [
    ("json", "json"), ({"type": "json_object"}, "json"), ("JSON", "json"),
    ({"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON, "strict": True}}, "json_schema"),
    (PERSON, "json_schema"), (json.dumps(PERSON), "json_schema"),
    ({"type": "regex", "pattern": "[0-9]{3}"}, "regex"),
    ({"type": "grammar", "grammar": 'start: "yes" | "no"'}, "grammar"),
    ({"type": "grammar", "grammar": 'root ::= "yes" | "no"'}, "grammar"),  # llama.cpp's GBNF
])
def test_response_formats_are_recognised(value, kind):
    fmt = parse_response_format(value)
    assert isinstance(fmt, ResponseFormat) and fmt.kind == kind


@pytest.mark.parametrize("value", [None, "text", "", {"type": "text"}])
def test_plain_text_is_no_format(value):
    assert parse_response_format(value) is None


@pytest.mark.parametrize("value, message", [
    ({"type": "json_schema", "json_schema": {"schema": {"type": "strin"}}}, "Invalid type: strin"),
    ({"type": "string", "format": "blob"}, "Unknown format: blob"),
    ({"$ref": "#/nowhere"}, "does not exist"),
    ({"type": "regex", "pattern": "[a-"}, "unclosed character class"),
    ({"type": "grammar", "grammar": "start: foo"}, "unknown name"),
    ({"type": "json_schema", "json_schema": {"schema": 5}}, "must be a JSON Schema object"),
    ({"colour": "blue"}, "unknown response format"),
    ("yaml", "neither 'json', 'text' nor a JSON schema"),
    (5, "expected a string or an object"),
])
def test_bad_formats_are_clear_errors(value, message):
    with pytest.raises(InvalidRequestError, match=re.escape(message)):
        parse_response_format(value)


def test_the_schema_set_is_valid_json_schema():
    assert len(SCHEMAS) >= 10
    for name, _, schema in SCHEMAS:
        jsonschema.Draft202012Validator.check_schema(schema)
        assert parse_response_format(schema).kind == "json_schema", name


# ------------------------------------------------------------------------------------------------- generating

def test_every_kind_of_format_is_followed(smollm2_model):
    m = smollm2_model
    out = m.generate("Describe a person.", json_schema=PERSON, max_tokens=64)
    jsonschema.validate(json.loads(out), PERSON)
    out = m.chat([{"role": "user", "content": "Tell me about cats."}], format="json", max_tokens=200,
                 temperature=0.8, seed=3)  # sampled, not only greedy
    assert isinstance(json.loads(out), dict)
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", m.generate("A phone number:", regex=r"[0-9]{3}-[0-9]{4}", max_tokens=16))
    assert m.generate("Is water wet?", grammar='root ::= "yes" | "no"', max_tokens=8) in ("yes", "no")
    pieces = list(m.stream("Describe a person.", response_format={"type": "json_schema", "json_schema": {
        "name": "person", "schema": PERSON}}, max_tokens=64))
    stats = pieces[-1]
    assert stats.format_complete is True and stats.stop_reason in ("eos", "stop")
    assert list(m.stream("Hi", max_tokens=4))[-1].format_complete is None


def test_cut_off_output_is_never_returned_as_complete(smollm2_model):
    m = smollm2_model
    pieces = list(m.stream("Describe a person.", json_schema=PERSON, max_tokens=6))
    assert pieces[-1].stop_reason == "length" and pieces[-1].format_complete is False
    with pytest.raises(IncompleteOutputError, match="raise max_tokens") as e:
        m.generate("Describe a person.", json_schema=PERSON, max_tokens=6)
    assert e.value.text.startswith('{"name":') and not validates(e.value.text, {"type": "object"})
    # a grammar whose forced text alone is longer than max_tokens fails before generating
    with pytest.raises(InvalidRequestError, match="needs at least .* tokens but max_tokens is 10"):
        m.generate("Say a", regex="a{1000}", max_tokens=10)
    with pytest.raises(InvalidRequestError, match="not several"):
        m.generate("x", format="json", regex="a")


@pytest.mark.parametrize("gguf", ["smollm2_gguf", "gemma3_gguf"])
def test_constrained_generations_always_validate(request, gguf, record_property):
    """Every schema of the benchmark's set, three subjects each, batched 8 rows with a grammar per row: every answer
    validates (``benchmarks/structured_output.py`` runs 200+ per model, beside the unconstrained rate)."""
    from mlx_engine.api import Model

    path = request.getfixturevalue(gguf)
    model = Model(gguf, path, max_sequences=8, context_length=1024)
    outcomes, _ = run(model, 3, constrained=True, batch=8)
    model.close()
    record_property("constrained_valid", f"{sum(o.valid for o in outcomes)}/{len(outcomes)}")
    assert len(outcomes) == 3 * len(SCHEMAS)
    assert [o for o in outcomes if not o.valid] == []


def test_batched_rows_keep_their_own_grammar(smollm2_model):
    """Rows of one batch with different formats (and one without) each follow their own."""
    from mlx_engine.api import GenerationOptions

    m = smollm2_model
    forms = [{"regex": "[0-9]{4}"}, {"json_schema": PERSON}, {"grammar": 'start: "yes" | "no"'}, {}]
    reqs = [GenerationOptions.parse({"max_tokens": 48, **f}).request(m.prompt_tokens("Describe a person."), sequence=i)
            for i, f in enumerate(forms)]
    m.runner.reset()
    rows = m.runner.generate_batch(reqs)
    m.runner.reset()
    texts = [m.tokenizer.decode([t for t in r if t not in m.tokenizer.eos_ids]) for r in rows]
    assert re.fullmatch("[0-9]{4}", texts[0]) and validates(texts[1], PERSON) and texts[2] in ("yes", "no")
    assert not validates(texts[3], PERSON)  # the free row is free


# ---------------------------------------------------------------------------------------------------- the doors

def test_cli_formats(home_with_smollm2, tmp_path):
    from mlx_engine.cli.main import main

    schema = tmp_path / "person.json"
    schema.write_text(json.dumps(PERSON))
    r = CliRunner().invoke(main, ["run", "Describe a person.", "--json-schema", str(schema)])
    assert r.exit_code == 0, r.output
    jsonschema.validate(json.loads(r.stdout), PERSON)
    r = CliRunner().invoke(main, ["run", "Describe a person.", "--json-schema", str(schema), "-n", "6"])
    assert r.exit_code == 1 and "cut off before it was complete" in r.output
    r = CliRunner().invoke(main, ["run", "Say a number.", "--regex", "[0-9"])
    assert r.exit_code == 1 and "Error: the regular expression: invalid" in r.output
    r = CliRunner().invoke(main, ["run", "Say a number.", "--grammar", str(tmp_path / "missing.lark")])
    assert r.exit_code == 1 and "cannot read" in r.output


def test_server_formats_with_the_real_clients(smollm2_server):
    import ollama
    import openai

    srv = smollm2_server
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused")
    messages = [{"role": "user", "content": "Describe a person."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    reply = client.chat.completions.create(model="smollm2:135m", messages=messages, response_format=fmt,
                                           max_tokens=64)
    jsonschema.validate(json.loads(reply.choices[0].message.content), PERSON)
    stream = client.chat.completions.create(model="smollm2:135m", messages=messages, response_format=fmt,
                                            max_tokens=64, stream=True)
    jsonschema.validate(json.loads("".join(c.choices[0].delta.content or "" for c in stream)), PERSON)
    cut = client.chat.completions.create(model="smollm2:135m", messages=messages,
                                         response_format={"type": "json_object"}, max_tokens=4)
    assert cut.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError, match="Invalid type: strin"):
        client.chat.completions.create(model="smollm2:135m", messages=messages, stream=True, response_format={
            "type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "strin"}}})
    o = ollama.Client(host=srv.url)
    answer = o.chat(model="smollm2:135m", messages=messages, format=PERSON, options={"num_predict": 64})
    jsonschema.validate(json.loads(answer.message.content), PERSON)
    assert isinstance(json.loads(o.generate(model="smollm2:135m", prompt="Name a colour.", format="json",
                                            options={"num_predict": 64}).response), dict)
    with pytest.raises(ollama.ResponseError) as e:
        o.generate(model="smollm2:135m", prompt="x", format={"type": "strin"})
    assert e.value.status_code == 400
