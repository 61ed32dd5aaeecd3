"""gpt-oss's tool calls in the harmony format (a message to ``functions.NAME`` on the ``commentary`` channel, ended
by ``<|call|>``), at every door: the parser, the Python API and the server's chat completions with the real
``openai`` client, and the call's result rendered back through gpt-oss's own chat template (llama.cpp's copy of the
released one).

The model is a tiny random transformers ``GptOss`` folder holding smollm2's tokenizer with harmony's special tokens
added and gpt-oss's template. Its output is forced by ``tool_choice`` (a grammar over harmony's special tokens and the
function's JSON Schema, an analysis message allowed first, as llama.cpp's), so the text it writes is known to be a
well-formed call; what is checked is what each door makes of it. Its layer writes nothing back (attention and experts
project to zero), so its logits are the head's view of the current token alone, and the head is scripted for a few
tokens (:data:`SCRIPT`): given the choice, it opens the analysis channel and thinks "Need the weather." before it
calls."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mlx_engine.models.text.reasoning import HarmonyParser
from mlx_engine.models.text.tools import ToolStyle, parse_tool_calls, prepare_messages, tool_style

torch = pytest.importorskip("torch")

HARMONY_TOKENS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                   "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
HARMONY = ToolStyle("harmony", True)
THOUGHT = "Need the weather."
# the head's pairs (this token -> the next): the analysis channel, then THOUGHT's tokens (smollm2's), then its end
SCRIPT = ["<|channel|>", "analysis", "<|message|>", "Need", "Ġthe", "Ġweather", ".", "<|end|>"]


def _template() -> str:
    from tests.hf_gguf import llama_cpp_source

    return (llama_cpp_source() / "models" / "templates" / "openai-gpt-oss-120b.jinja").read_text()


def _parse(chunks):
    p = HarmonyParser()
    out = [x for c in chunks for x in p.feed(c)] + p.flush()
    answer = "".join(t for k, t in out if k == "answer")
    return "".join(t for k, t in out if k == "thinking"), parse_tool_calls(answer, HARMONY, {"get_weather"})


def test_a_call_is_parsed_wherever_the_stream_is_cut():
    """Both places harmony puts the recipient (after the channel, as gpt-oss writes it; in the role, as the
    template renders it), a preamble before, the thinking apart, and ``<|call|>`` given or not (a stop token)."""
    for raw in ("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
                'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>',
                '<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant to=functions.get_weather'
                '<|channel|>commentary json<|message|>{"city": "Paris"}'):
        for i in range(0, len(raw) + 1, 3):
            thinking, (text, calls) = _parse([raw[:i], raw[i:]])
            assert thinking == "Need the weather." and text == "", (raw, i)
            assert [(c.name, c.arguments) for c in calls] == [("get_weather", {"city": "Paris"})], (raw, i)
    thinking, (text, calls) = _parse(["<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant "
                                      "to=functions.nope<|channel|>commentary<|message|>{}<|call|>"])
    assert calls == [] and text.startswith("Checking.<|start|>assistant to=functions.nope")  # not offered: text


def test_the_template_renders_each_call_and_its_result():
    """Two calls in one assistant message and their results (in the other order) go to gpt-oss's template as one
    call each followed by its result, which the template names after that call."""
    from mlx_engine.models.text.chat_template import render_chat_template

    source = _template()
    assert tool_style(source) == HARMONY
    calls = [{"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
             {"id": "b", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]
    messages = ASK + [{"role": "assistant", "content": "", "tool_calls": calls},
                      {"role": "tool", "tool_call_id": "b", "content": "12:00"},
                      {"role": "tool", "tool_call_id": "a", "content": "sunny"}]
    text = render_chat_template(source, prepare_messages(messages, [WEATHER], HARMONY), tools=[WEATHER],
                                add_generation_prompt=True)
    assert ('<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}'
            '<|call|><|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"sunny"<|end|>'
            '<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{}<|call|>'
            '<|start|>functions.get_time to=assistant<|channel|>commentary<|message|>"12:00"<|end|>') in text
    assert "get_weather" in text.split("<|start|>user")[0]  # the tools offered in the developer message


@pytest.fixture(scope="module")
def folder(tmp_path_factory, smollm2_gguf) -> Path:
    """The tiny gpt-oss folder (module docstring)."""
    from transformers import AutoModelForCausalLM, GptOssConfig

    from tests import arch_proof
    from tests.hf_gguf import peaked

    root = tmp_path_factory.mktemp("gpt_oss_tools") / "hf"
    config = GptOssConfig(vocab_size=49160, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_local_experts=2,
                          num_experts_per_tok=1, sliding_window=8, layer_types=["full_attention"],
                          max_position_embeddings=1024, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    peaked(model, seed=0)
    root.mkdir()
    arch_proof.smollm2_tokenizer(smollm2_gguf)(root)
    tok = json.loads((root / "tokenizer.json").read_text())
    tok["added_tokens"] += [{"id": 49152 + i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                             "normalized": False, "special": True} for i, t in enumerate(HARMONY_TOKENS)]
    (root / "tokenizer.json").write_text(json.dumps(tok))
    ids = {**tok["model"]["vocab"], **{t["content"]: t["id"] for t in tok["added_tokens"]}}
    with torch.no_grad():
        layer = model.model.layers[0]
        for p in (layer.self_attn.o_proj.weight, layer.self_attn.o_proj.bias, layer.mlp.experts.down_proj,
                  layer.mlp.experts.down_proj_bias):
            p.zero_()  # the residual stream stays the current token's embedding
        model.model.norm.weight.fill_(1.0)
        for k, (a, b) in enumerate(zip(SCRIPT, SCRIPT[1:])):
            # token a's embedding is dimension k alone (RMS-normed to sqrt(32)); b's head row reads it: logit 10 *
            # sqrt(32) = 57, where the random rows reach about 4.2 sd = 17
            model.model.embed_tokens.weight[ids[a]] = torch.eye(32)[k]
            model.lm_head.weight[ids[b], k] = 10.0
    model.save_pretrained(root)
    cfg = json.loads((root / "tokenizer_config.json").read_text())
    (root / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": _template(),
                                                            "eos_token": "<|return|>", "add_bos_token": False}))
    (root / "generation_config.json").write_text(json.dumps({"eos_token_id": [49157, 49158]}))
    return root


@pytest.fixture(scope="module")
def model(folder):
    import mlx_engine

    m = mlx_engine.load(str(folder), progress=False, context_length=1024)
    yield m
    m.close()


def test_the_api_returns_the_forced_call(model):
    reply = model.respond(ASK, tools=[WEATHER], tool_choice="required", max_tokens=40)
    assert reply.finish_reason == "tool_calls" and reply.content == "" and reply.thinking == THOUGHT
    assert [c.name for c in reply.tool_calls] == ["get_weather"]
    assert set(reply.tool_calls[0].arguments) == {"city"} and isinstance(reply.tool_calls[0].arguments["city"], str)


# ---- the server, from the folder and from llama.cpp's GGUF of it ---------------------------------------------------


@pytest.fixture(scope="module")
def gguf(folder, tmp_path_factory) -> Path:
    """llama.cpp's F32 GGUF of :func:`folder` (its converter keeps the added harmony tokens and the template)."""
    from tests.hf_gguf import convert

    return convert(folder, tmp_path_factory.mktemp("gpt_oss_gguf") / "tiny-gpt-oss.gguf", "f32")


@pytest.fixture(scope="module")
def server(folder, gguf, tmp_path_factory):
    """An HTTP server serving the folder as ``harmony:hf`` and its GGUF as ``harmony:gguf`` from a store."""
    from mlx_engine.server import ServerConfig
    from mlx_engine.store import Store
    from mlx_engine.store.manifest import write_manifest
    from tests.test_server import RunningServer, free_port

    root = tmp_path_factory.mktemp("harmony-home")
    for name, files in (("harmony:hf", list(folder.iterdir())), ("harmony:gguf", [gguf])):
        dest = Store(root).model_dir(name)
        dest.mkdir(parents=True)
        for f in files:
            (dest / f.name).symlink_to(f)
        listed = [{"name": f.name, "size": f.stat().st_size} for f in files]
        write_manifest(dest, {"name": name, "source": "file", "files": listed,
                              "size": sum(f["size"] for f in listed), "sha256": None,
                              **({"model_file": gguf.name} if files == [gguf] else {})})
    srv = RunningServer(ServerConfig(port=free_port(), models=["harmony:hf"], max_sequences=2, context_length=1024,
                                     store_root=str(root)))
    yield srv
    srv.stop()


def test_the_end_tokens_are_llama_cpps(model, gguf):
    """``<|end|>`` closes a harmony message, not the turn: llama.cpp takes it off its end-of-generation list when
    ``<|return|>`` and ``<|call|>`` are on it; among harmony's tokens, the folder's and the GGUF's end tokens are the
    ones llama.cpp stops at (smollm2's own FIM token ``<reponame>`` is on llama.cpp's list alone, another matter)."""
    import mlx_engine
    from tests.hf_gguf import llama_cpp_eog_ids

    harmony = set(range(49152, 49152 + len(HARMONY_TOKENS)))
    eog = llama_cpp_eog_ids(gguf) & harmony
    assert eog == {49157, 49158}  # <|return|>, <|call|>; not <|end|> (49153)
    assert model.tokenizer.eos_ids & harmony == eog
    m = mlx_engine.load(str(gguf), progress=False, context_length=256)
    try:
        assert m.tokenizer.eos_ids & harmony == eog
    finally:
        m.close()


@pytest.mark.parametrize("name", ["harmony:hf", "harmony:gguf"])
def test_the_server_returns_the_call_and_its_reasoning(server, folder, name):
    """Chat Completions with the real ``openai`` client, not streamed and streamed: the forced call in ``tool_calls``
    (arguments valid for the schema), the analysis in ``reasoning_content``; then the call, its reasoning and the
    tool's result sent back render as transformers renders them with the released template."""
    import jsonschema
    import openai
    from transformers import AutoTokenizer

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    ask = dict(model=name, messages=ASK, tools=[WEATHER], temperature=0.0, max_tokens=60)
    r = client.chat.completions.create(**ask, tool_choice="required")
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.reasoning_content == THOUGHT
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, WEATHER["function"]["parameters"])

    chunks = list(client.chat.completions.create(**ask, stream=True,
                                                 tool_choice={"type": "function",
                                                              "function": {"name": "get_weather"}}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == THOUGHT
    assert "".join(d.content or "" for d in deltas) == ""
    streamed = [tc for d in deltas for tc in (d.tool_calls or [])]
    assert streamed[0].function.name == "get_weather" and chunks[-1].choices[0].finish_reason == "tool_calls"
    assert json.loads("".join(tc.function.arguments or "" for tc in streamed)) == args  # greedy: the same call

    follow = ASK + [choice.message.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    final = client.chat.completions.create(model=name, messages=follow, tools=[WEATHER], max_tokens=2)
    expected = AutoTokenizer.from_pretrained(folder).apply_chat_template(
        ASK + [{"role": "assistant", "thinking": THOUGHT,
                "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": args}}]},
               {"role": "tool", "content": "sunny"}], tools=[WEATHER], add_generation_prompt=True, tokenize=False)
    assert f"<|channel|>analysis<|message|>{THOUGHT}<|end|>" in expected and '"sunny"' in expected
    assert final.usage.prompt_tokens == len(AutoTokenizer.from_pretrained(folder)(expected,
                                                                                  add_special_tokens=False).input_ids)
