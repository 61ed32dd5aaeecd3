"""The APIs coding agents speak, with their real clients from PyPI against one server on a loopback port: Anthropic's
Messages (``anthropic``) and OpenAI's Responses (``openai``).

Oracles: the Python API on the same weights (greedy text, the chat template's token counts, the tool prompt's), the
clients' own parsing of every answer and event, and ``jsonschema`` for structured output.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest

import mlx_engine
from mlx_engine.models.text.tools import check_tools
from mlx_engine.server import ServerConfig
from tests.conftest import link_model
from tests.doc_examples import blocks
from tests.test_server import RunningServer, free_port

MODEL = "smollm2:135m"
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = {"name": "get_weather", "description": "The current weather of a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                            "required": ["city"]}}
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16}}, "required": ["city"],
        "additionalProperties": False}


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm2_gguf):
    root = tmp_path_factory.mktemp("agent-home")
    link_model(smollm2_gguf.parent, root)
    srv = RunningServer(ServerConfig(port=free_port(), models=[MODEL], max_sequences=4,
                                                       context_length=2048, store_root=str(root),
                                                       max_body_bytes=2**20))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def reference(smollm2_gguf):
    return mlx_engine.Model(MODEL, smollm2_gguf, context_length=2048)


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def greedy(model, messages, max_tokens):
    model.runner.reset()
    return model.chat(messages, max_tokens=max_tokens)


def _function(tool):  # Anthropic's tool as Chat Completions' function
    return {"type": "function", "function": {"name": tool["name"], "description": tool["description"],
                                             "parameters": tool["input_schema"]}}


# ---- Anthropic Messages -------------------------------------------------------------------------------------------


def test_messages_text_streamed_and_stop_sequence(claude, reference):
    want = greedy(reference, FRANCE, 24)
    m = claude.messages.create(model=MODEL, max_tokens=24, messages=FRANCE)
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == want
    assert (m.type, m.role, m.model, m.stop_sequence) == ("message", "assistant", MODEL, None)
    assert m.id.startswith("msg_") and m.stop_reason in ("end_turn", "max_tokens")
    prompt = len(reference.chat_tokens(FRANCE))
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == prompt and m.usage.output_tokens > 0
    with claude.messages.stream(model=MODEL, max_tokens=24, messages=FRANCE) as stream:
        deltas = [e.delta.text for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert "".join(deltas) == final.content[0].text == want
    assert final.usage.cache_read_input_tokens > 0 and final.stop_reason == m.stop_reason
    word = want.split()[-1].strip(".!")  # a stop sequence the answer holds: cut before it, and named
    m = claude.messages.create(model=MODEL, max_tokens=24, messages=FRANCE, stop_sequences=["zzz", word])
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", word)
    assert m.content[0].text == want[:want.index(word)]


def test_messages_tool_use_round_trip(claude, reference):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    forced = {"type": "tool", "name": "get_weather"}
    m = claude.messages.create(model=MODEL, max_tokens=40, messages=ask, tools=[WEATHER], tool_choice=forced)
    assert m.stop_reason == "tool_use" and [b.type for b in m.content] == ["tool_use"]
    use = m.content[0]
    assert use.name == "get_weather" and use.id.startswith("toolu_")
    jsonschema.validate(use.input, WEATHER["input_schema"])
    prompt = reference.tool_prompt(ask, [_function(WEATHER)], {"type": "function", "function": {"name": "get_weather"}})
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == len(prompt.tokens)
    with claude.messages.stream(model=MODEL, max_tokens=40, messages=ask, tools=[WEATHER],
                                tool_choice={"type": "any"}) as stream:
        kinds = [(e.type, e.delta.type if e.type == "content_block_delta" else None) for e in stream]
        final = stream.get_final_message()
    assert ("content_block_delta", "input_json_delta") in kinds and kinds[-1][0] == "message_stop"
    assert final.stop_reason == "tool_use" and final.content[0].input == use.input  # greedy: the same call
    turn = ask + [{"role": "assistant", "content": [use.model_dump(include={"type", "id", "name", "input"})]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                "content": [{"type": "text", "text": "Sunny, 21 degrees"}]}]}]
    m = claude.messages.create(model=MODEL, max_tokens=24, messages=turn, tools=[WEATHER])
    assert m.stop_reason in ("end_turn", "max_tokens") and m.content[0].type == "text" and m.content[0].text
    chat = ask + [{"role": "assistant", "content": "", "tool_calls": [{"id": use.id, "type": "function", "function": {
        "name": use.name, "arguments": json.dumps(use.input)}}]},
                  {"role": "tool", "tool_call_id": use.id, "content": "Sunny, 21 degrees"}]
    want = reference.tool_prompt(chat, [_function(WEATHER)])
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == len(want.tokens)
    assert m.usage.cache_read_input_tokens > 0  # the call's conversation was in the cache


def test_count_tokens_is_the_chat_templates(claude, reference):
    system = "You are terse."
    got = claude.messages.count_tokens(model=MODEL, system=[{"type": "text", "text": system}], messages=FRANCE)
    assert got.input_tokens == len(reference.chat_tokens([{"role": "system", "content": system}, *FRANCE]))
    got = claude.messages.count_tokens(model=MODEL, messages=FRANCE, tools=[WEATHER])
    assert got.input_tokens == len(reference.tool_prompt(FRANCE, [_function(WEATHER)]).tokens)


def test_messages_errors_in_anthropics_form(claude, server, smollm2_gguf, tmp_path):
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model=MODEL, max_tokens=0, messages=FRANCE)
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as e:
        claude.messages.create(model="no-such-model:1b", max_tokens=8, messages=FRANCE)
    assert e.value.body["error"]["type"] == "not_found_error"
    r = httpx.post(server.url + "/v1/messages", json={"model": MODEL, "messages": FRANCE})  # max_tokens required
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in r.json()["error"]["message"]
    r = httpx.get(server.url + "/v1/messages")
    assert r.status_code == 405 and r.json()["type"] == "error"
    link_model(smollm2_gguf.parent, tmp_path)  # the API key: Bearer or x-api-key, refusals in each API's form
    keyed = RunningServer(ServerConfig(port=free_port(), api_key="sesame", store_root=str(tmp_path)))
    try:
        r = httpx.post(keyed.url + "/v1/messages", json={})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert httpx.get(keyed.url + "/v1/models", headers={"x-api-key": "wrong"}).status_code == 401
        assert httpx.get(keyed.url + "/v1/models", headers={"x-api-key": "sesame"}).status_code == 200
        assert httpx.get(keyed.url + "/v1/models", headers={"Authorization": "Bearer sesame"}).status_code == 200
        with pytest.raises(anthropic.NotFoundError):  # past the key check (the SDK sends x-api-key): the model
            anthropic.Anthropic(base_url=keyed.url, api_key="sesame", max_retries=0).messages.count_tokens(
                model="no-such-model:1b", messages=FRANCE)
        with pytest.raises(anthropic.AuthenticationError):
            anthropic.Anthropic(base_url=keyed.url, api_key="wrong", max_retries=0).messages.count_tokens(
                model="no-such-model:1b", messages=FRANCE)
    finally:
        keyed.stop()


def test_agent_loop_prefills_only_the_new_tokens(claude, reference):
    """Six turns of a growing conversation: from the second on, the prefix cache serves every earlier turn and only
    the new tokens (the last answer's and the new question's) are prefilled."""
    questions = ["Name a fruit.", "Name a colour.", "Name an animal.", "Name a country.", "Name a river.",
                 "Name a planet."]
    conversation: list[dict] = []
    chat = [{"role": "system", "content": "You are terse."}]  # the same conversation, as the Python API takes it
    before = 0
    for turn, q in enumerate(questions):
        conversation.append({"role": "user", "content": q})
        chat.append({"role": "user", "content": q})
        m = claude.messages.create(model=MODEL, max_tokens=12, system="You are terse.", messages=conversation)
        prompt = len(reference.chat_tokens(chat))
        u = m.usage
        assert u.input_tokens + u.cache_read_input_tokens == prompt
        if turn:
            assert u.cache_read_input_tokens >= before, (turn, u)  # every earlier turn from the cache
            assert u.input_tokens <= prompt - before, (turn, u)  # prefilled: the new tokens only
        before = prompt
        conversation.append({"role": "assistant", "content": [{"type": "text", "text": m.content[0].text}]})
        chat.append({"role": "assistant", "content": m.content[0].text})


# ---- OpenAI Responses ---------------------------------------------------------------------------------------------


def test_responses_text_and_streamed_events(oai, reference):
    want = greedy(reference, FRANCE, 24)
    r = oai.responses.create(model=MODEL, input=FRANCE[0]["content"], max_output_tokens=24)
    assert r.output_text == want and r.status in ("completed", "incomplete") and r.id.startswith("resp_")
    assert r.usage.input_tokens == len(reference.chat_tokens(FRANCE)) and r.usage.output_tokens > 0
    events = list(oai.responses.create(model=MODEL, input=FRANCE, max_output_tokens=24, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed" if r.status == "completed" else "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == want == events[-1].response.output_text
    assert events[-1].response.usage.input_tokens_details.cached_tokens > 0
    r = oai.responses.create(model=MODEL, instructions="You are terse.", input=[
        {"role": "user", "content": [{"type": "input_text", "text": FRANCE[0]["content"]}]}], max_output_tokens=4)
    assert r.usage.input_tokens == len(reference.chat_tokens([{"role": "system", "content": "You are terse."},
                                                              *FRANCE]))
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"


def test_responses_function_call_round_trip_stored(oai, reference):
    tool = {"type": "function", "name": WEATHER["name"], "description": WEATHER["description"],
            "parameters": WEATHER["input_schema"]}
    ask = "What is the weather in Paris?"
    r = oai.responses.create(model=MODEL, input=ask, tools=[tool], tool_choice="required", max_output_tokens=40)
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["input_schema"])
    stream = oai.responses.create(model=MODEL, input=ask, tools=[tool], tool_choice="required",
                                  max_output_tokens=40, stream=True, store=False)
    args = "".join(e.delta for e in stream if e.type == "response.function_call_arguments.delta")
    assert args == call.arguments  # greedy: the same call, streamed
    r2 = oai.responses.create(model=MODEL, previous_response_id=r.id, tools=[tool], max_output_tokens=24, input=[
        {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 degrees"}])
    assert r2.previous_response_id == r.id and r2.output_text
    chat = [{"role": "user", "content": ask},
            {"role": "assistant", "content": "", "tool_calls": [{"id": call.call_id, "type": "function", "function": {
                "name": call.name, "arguments": call.arguments}}]},
            {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 21 degrees"}]
    assert r2.usage.input_tokens == len(reference.tool_prompt(chat, check_tools([tool])).tokens)
    assert r2.usage.input_tokens_details.cached_tokens > 0
    got = oai.responses.retrieve(r2.id)  # GET and DELETE of the stored response
    assert got.id == r2.id and got.output_text == r2.output_text
    oai.responses.delete(r2.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(r2.id)
    with pytest.raises(openai.BadRequestError) as e:  # a deleted response cannot be continued
        oai.responses.create(model=MODEL, previous_response_id=r2.id, input="And tomorrow?")
    assert e.value.body["param"] == "previous_response_id"


def test_responses_json_schema_format(oai):
    fmt = {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}
    r = oai.responses.create(model=MODEL, input="Name a city in Japan.", text={"format": fmt}, max_output_tokens=32)
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), CITY)
    with oai.responses.stream(model=MODEL, input="Name a city in Japan.", text={"format": fmt},
                              max_output_tokens=32) as stream:
        final = stream.get_final_response()
    assert final.output_text == r.output_text


# ---- hostile input ------------------------------------------------------------------------------------------------


def _hostile() -> list[tuple[str, str, bytes]]:
    good = {"model": MODEL, "max_tokens": 8, "messages": FRANCE}
    user = lambda *blocks: {**good, "messages": [{"role": "user", "content": list(blocks)}]}  # noqa: E731
    messages = [
        {}, {"model": 3}, {"model": MODEL, "messages": FRANCE}, {**good, "max_tokens": 0}, {**good, "max_tokens": "8"},
        {**good, "max_tokens": 10**30}, {**good, "max_tokens": 1e30}, {**good, "messages": []},
        {**good, "messages": "hi"}, {**good, "messages": [{"role": "system", "content": "x"}]},
        {**good, "messages": [{"role": "user", "content": 5}]}, user({"type": "video"}),
        user({"type": "image", "source": {"type": "url", "url": "http://example.com/a.png"}}),
        user({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "aGk="}}),
        user({"type": "tool_result", "content": "x"}), user({"type": "tool_use", "id": "a", "name": "f", "input": {}}),
        {**good, "messages": FRANCE + [{"role": "assistant", "content": "The capital"}]},
        {**good, "temperature": 5}, {**good, "temperature": -1}, {**good, "temperature": "hot"},
        {**good, "temperature": float("nan")}, {**good, "top_p": 0}, {**good, "top_k": -1}, {**good, "top_k": 10**30},
        {**good, "stop_sequences": "x"}, {**good, "stop_sequences": [5]}, {**good, "stop_sequences": ["a"] * 100},
        {**good, "tools": [{"name": 5}]}, {**good, "tools": [{"name": "a b"}]},
        {**good, "tools": [{"name": "t", "input_schema": {"type": "strin"}}]},
        {**good, "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
        {**good, "tool_choice": {"type": "tool"}}, {**good, "tool_choice": {"type": "any"}},
        {**good, "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}},
        {**good, "tool_choice": {"type": "magic"}}, {**good, "thinking": {"type": "enabled", "budget_tokens": 0}},
        {**good, "thinking": "yes"}, {**good, "system": 5}, {**good, "system": [{"type": "image"}]},
        {**good, "messages": [{"role": "user", "content": "a\u0000b"}]}, {**good, "model": "no-such-model"},
        {**good, "model": "../../etc/passwd"}, {**good, "messages": [{"role": "user", "content": "x " * 5000}]},
        {**good, "stream": "yes"}, {**good, "metadata": "x"}, {**good, "max_tokens": [8]},
    ]
    counted = {"model", "messages", "system", "tools", "tool_choice", "thinking"}  # what count_tokens reads
    count = [{k: v for k, v in m.items() if k != "max_tokens"} for m in messages
             if m.get("max_tokens") == 8 and set(m) <= counted | {"max_tokens"}]
    count = [m for m in count if m != {"model": MODEL, "messages": FRANCE} and "x x" not in str(m)]  # a long
    # prompt is counted, not refused
    base = {"model": MODEL, "input": "hi", "max_output_tokens": 8}
    item = lambda *items: {**base, "input": list(items)}  # noqa: E731
    responses = [
        {}, {"model": 3}, {"model": MODEL}, {**base, "input": 5}, {**base, "input": [5]},
        item({"role": "wizard", "content": "x"}), item({"type": "item_reference", "id": "x"}),
        item({"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}),
        item({"role": "user", "content": [{"type": "input_image", "image_url": "https://example.com/a.png"}]}),
        item({"type": "function_call", "name": "f", "arguments": "{}"}),
        item({"type": "function_call_output", "call_id": "c", "output": 5}),
        item({"role": "user", "content": [{"type": "output_text", "text": "x"}]}),
        {**base, "instructions": 5}, {**base, "tools": [{"type": "web_search"}]}, {**base, "tools": [{"type": "function"}]},
        {**base, "tool_choice": "sometimes"}, {**base, "tool_choice": {"type": "function"}},
        {**base, "tool_choice": "required"}, {**base, "text": {"format": {"type": "yaml"}}},
        {**base, "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "strin"}}}},
        {**base, "text": {"format": {"type": "json_schema", "name": "x", "schema": {"$ref": "#/nowhere"}}}},
        {**base, "reasoning": {"effort": "extreme"}}, {**base, "max_output_tokens": 0},
        {**base, "max_output_tokens": "8"}, {**base, "max_output_tokens": 10**30}, {**base, "temperature": 3},
        {**base, "top_p": 0}, {**base, "top_logprobs": 5}, {**base, "store": "yes"},
        {**base, "previous_response_id": "resp_nope"}, {**base, "stream": "yes"}, {**base, "metadata": {"a": 5}},
        {**base, "input": "a\u0000b"}, {**base, "input": "x " * 5000}, {**base, "model": "no-such-model"},
    ]
    bodies = [b"", b"{", b"[]", b"null", b"\xff\xfe", b"{" * 5000 + b"}" * 5000, b"1e999999"]
    out = []
    for path, variants in (("/v1/messages", messages), ("/v1/messages/count_tokens", count),
                           ("/v1/responses", responses)):
        out += [("POST", path, b) for b in bodies]
        out += [("POST", path, json.dumps(v, allow_nan=True).encode()) for v in variants]
    out += [("GET", "/v1/responses/resp_nope", b""), ("DELETE", "/v1/responses/resp_nope", b""),
            ("POST", "/v1/messages/nope", b"{}"), ("POST", "/v1/messages", b"x" * (2**20 + 10))]
    return out


def test_hostile_requests_get_4xx_in_each_apis_form(server, claude, reference):
    requests = _hostile()
    assert len(requests) >= 120
    with httpx.Client(base_url=server.url, timeout=60) as c:
        for method, path, body in requests:
            r = c.request(method, path, content=body, headers={"Content-Type": "application/json"})
            assert 400 <= r.status_code < 500, (path, body[:120], r.status_code, r.text[:200])
            got = r.json()
            if path.startswith("/v1/messages"):
                assert got["type"] == "error" and got["error"]["type"].endswith("_error") or \
                    got["error"]["type"] == "request_too_large", (path, body[:80], got)
                message = got["error"]["message"]
            else:
                assert got["error"]["code"] == r.status_code, (path, body[:80], got)
                message = got["error"]["message"]
            assert message and "Traceback" not in message, (path, body[:80], got)
        # the browser guard and the Content-Type check answer in Anthropic's form too
        r = c.post("/v1/messages", content=b"{}", headers={"Content-Type": "text/plain"})
        assert r.status_code == 415 and r.json()["type"] == "error"
        r = c.post("/v1/messages", json={}, headers={"Host": "attacker.example"})
        assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
        r = c.post("/v1/responses", json={}, headers={"Origin": "https://attacker.example"})
        assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
    m = claude.messages.create(model=MODEL, max_tokens=24, messages=FRANCE)  # and it answers as before
    assert m.content[0].text == greedy(reference, FRANCE, 24)


# ---- the documentation ----------------------------------------------------------------------------------------------


def test_the_docs_examples_run(server, capsys):
    """docs/server.md's Anthropic and Responses examples as written, against this module's server."""
    examples = [b.text for b in blocks("python") if b.file == "docs/server.md"
                and ("anthropic.Anthropic(" in b.text or "responses.create(" in b.text)]
    assert len(examples) == 2
    for text in examples:
        exec(compile(text.replace("http://127.0.0.1:11435", server.url), "docs/server.md", "exec"), {})
    out = capsys.readouterr().out
    assert "Paris" in out and "cached" in out
