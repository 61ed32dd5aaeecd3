"""Tool calling: the tool style of a template, messages prepared for it, calls parsed from each family's output, a
grammar that forces a valid call, and round trips on the real model through the Python API and the server's OpenAI
and ollama routes (the real clients: tools offered, a call made, its result sent back, the answer)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from mlx_engine.errors import InvalidRequestError
from mlx_engine.models.text.tools import (ToolStyle, check_tools, parse_tool_calls, prepare_messages, tool_choice_format,
                                     tool_style)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time in a time zone.",
                                         "parameters": {"type": "object", "properties": {"zone": {"type": "string"}},
                                                        "required": ["zone"]}}}
HERMES, LLAMA3, GENERIC = ToolStyle("hermes", True), ToolStyle("llama3", True), ToolStyle("hermes", False)


def test_tool_style_of_templates():
    assert tool_style(None) == GENERIC
    assert tool_style("{% for m in messages %}{{ m.content }}{% endfor %}") == GENERIC  # SmolLM2-like: no tools
    qwen = "{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools><tool_call>{% endif %}"
    assert tool_style(qwen) == HERMES
    llama = ('{% if tools %}Respond in the format {"name": function name, "parameters": dictionary}{% endif %}'
             '{% if m.role == "ipython" %}{% endif %}')
    assert tool_style(llama) == LLAMA3


def test_check_tools():
    assert check_tools([WEATHER])[0]["function"]["name"] == "get_weather"
    assert check_tools([WEATHER["function"]])[0]["type"] == "function"  # a bare function
    for bad, message in [([], "non-empty list"), ([{"type": "retrieval"}], "must be"),
                         ([{"type": "function", "function": {"name": "a b"}}], "name of letters"),
                         ([WEATHER, WEATHER], "two tools"),
                         ([{"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}],
                          "Invalid type")]:
        with pytest.raises(InvalidRequestError, match=message):
            check_tools(bad)


def test_parse_each_form():
    text, calls = parse_tool_calls('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                                   '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}'
                                   '\n</tool_call>', HERMES, {"get_weather", "get_time"})
    assert text == "" and [(c.name, c.arguments) for c in calls] == [("get_weather", {"city": "Paris"}),
                                                                    ("get_time", {"zone": "CET"})]
    text, calls = parse_tool_calls('Let me check.\n<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": '
                                   '\\"Oslo\\"}"}', HERMES)  # unterminated, string arguments
    assert text == "Let me check." and calls[0].arguments == {"city": "Oslo"}
    text, calls = parse_tool_calls('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}', LLAMA3)
    assert calls[0].arguments == {"city": "Rome"} and text == ""
    assert parse_tool_calls("The weather is fine.", HERMES) == ("The weather is fine.", [])
    assert parse_tool_calls('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', HERMES,
                            {"get_weather"})[1] == []  # a function that was not offered stays text
    assert parse_tool_calls('{"name": "get_weather", "parameters": {"city"', LLAMA3)[1] == []  # broken JSON


def test_generic_form_puts_tools_in_the_system_message():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
                {"role": "tool", "tool_call_id": "call_2", "content": "CET 10:00"}]
    out = prepare_messages(messages, check_tools([WEATHER]), GENERIC)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].startswith("Be brief.\n\n# Tools") and '"get_weather"' in out[0]["content"]
    assert out[2]["content"] == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert out[3]["content"] == ("<tool_response>\n18 C, sunny\n</tool_response>\n"
                                 "<tool_response>\nCET 10:00\n</tool_response>")
    native = prepare_messages(messages, check_tools([WEATHER]), HERMES)
    assert native[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"} and native[2]["content"] == ""
    assert native[0] == messages[0] and native[3]["role"] == "tool"


def test_forced_call_grammar():
    tools = check_tools([WEATHER, TIME])
    assert tool_choice_format(tools, "auto", GENERIC) is None and tool_choice_format(tools, "none", GENERIC) is None
    assert tool_choice_format(tools, "required", GENERIC).kind == "grammar"
    assert tool_choice_format(tools, {"type": "function", "function": {"name": "get_time"}}, LLAMA3).kind == "grammar"
    with pytest.raises(InvalidRequestError, match="tool_choice"):
        tool_choice_format(tools, {"type": "function", "function": {"name": "nope"}}, GENERIC)
    with pytest.raises(InvalidRequestError, match="tool_choice"):
        tool_choice_format(tools, "sometimes", GENERIC)


# ------------------------------------------------------------------------------------------------- real model

def test_required_and_named_calls_validate(smollm2_model):
    m = smollm2_model
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    reply = m.respond(messages, tools=[WEATHER, TIME], tool_choice="required", max_tokens=80)
    assert reply.tool_calls and reply.content == "" and reply.finish_reason == "tool_calls"
    call = reply.tool_calls[0]
    assert call.name in ("get_weather", "get_time")
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}[call.name]
    jsonschema.validate(call.arguments, schema)
    named = m.respond(messages, tools=[WEATHER, TIME], max_tokens=80,
                      tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert [c.name for c in named.tool_calls] == ["get_time"]
    jsonschema.validate(named.tool_calls[0].arguments, TIME["function"]["parameters"])
    # the result goes back in, and the model answers in text
    follow = messages + [{"role": "assistant", "content": None, "tool_calls": [call.openai()]},
                         {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"}]
    final = m.respond(follow, tools=[WEATHER, TIME], tool_choice="none", max_tokens=40)
    assert final.content and not final.tool_calls and final.finish_reason in ("stop", "length")


def test_server_tool_round_trip_with_the_real_clients(smollm2_server):
    import ollama
    import openai

    srv = smollm2_server
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused")
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.chat.completions.create(model="smollm2:135m", messages=messages, tools=[WEATHER],
                                       tool_choice="required", max_tokens=80)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    # streamed: the call arrives as tool-call deltas
    chunks = list(client.chat.completions.create(model="smollm2:135m", messages=messages, tools=[WEATHER],
                                                 tool_choice="required", max_tokens=80, stream=True))
    deltas = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert deltas and deltas[0].function.name == "get_weather" and chunks[-1].choices[0].finish_reason == \
        "tool_calls"
    args = "".join(d.function.arguments or "" for d in deltas)
    jsonschema.validate(json.loads(args), WEATHER["function"]["parameters"])
    # the tool's result goes back; the model answers
    follow = messages + [choice.message.model_dump(exclude_none=True),
                         {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"}]
    final = client.chat.completions.create(model="smollm2:135m", messages=follow, tools=[WEATHER],
                                           tool_choice="none", max_tokens=40)
    assert final.choices[0].message.content and not final.choices[0].message.tool_calls
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        client.chat.completions.create(model="smollm2:135m", messages=messages, tools=[WEATHER],
                                       tool_choice={"type": "function", "function": {"name": "nope"}})

    o = ollama.Client(host=srv.url)
    # ollama has no tool_choice: its tools are "auto"; the forced call is asked through format-free options,
    # so this checks the request and the message shapes, whatever the small model decides
    answer = o.chat(model="smollm2:135m", messages=messages, tools=[WEATHER], options={"num_predict": 80})
    calls = answer.message.tool_calls or []
    for c in calls:
        assert c.function.name == "get_weather" and isinstance(c.function.arguments, dict)
    back = messages + [{"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "18 degrees and sunny", "tool_name": "get_weather"}]
    final = o.chat(model="smollm2:135m", messages=back, options={"num_predict": 40})
    assert final.message.content


def test_a_streamed_call_after_plain_text_is_held_and_parsed():
    from mlx_engine.models.generation.answer import ToolPrompt
    from mlx_engine.models.text.tools import ToolStyle
    from mlx_engine.server.tool_stream import ToolStream

    prompt = ToolPrompt([], None, ToolStyle("hermes", True), {"get_weather"})
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    for cut in range(1, len(call)):  # the tag may arrive split anywhere
        stream = ToolStream(prompt)
        sent = [stream.feed("Let me check the weather. "), stream.feed("I will look it up "),
                stream.feed(call[:cut]), stream.feed(call[cut:])]
        text, calls = stream.finish()
        assert "".join(sent) == "Let me check the weather. I will look it up " and text == ""
        assert [(c.name, c.arguments) for c in calls] == [("get_weather", {"city": "Paris"})]
    # a "<" that starts no tag is passed on as soon as it is clear
    stream = ToolStream(prompt)
    assert stream.feed("a < b and ") + stream.feed("<tool") + stream.feed("box") == "a < b and <toolbox"
    assert stream.finish() == ("", [])
    # Llama 3's form is a whole answer: after plain text nothing is held
    stream = ToolStream(ToolPrompt([], None, ToolStyle("llama3", True), {"get_weather"}))
    assert stream.feed("Sure. ") + stream.feed('{"name": "x"}') == 'Sure. {"name": "x"}'
