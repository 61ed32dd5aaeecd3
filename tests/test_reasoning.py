"""Reasoning kept apart from the answer, at every door.

The parser is held to every way a stream can be cut. End to end, a tiny Llama-architecture model is built whose
greedy output is known in advance: its embedding is the identity, its attention and MLP write nothing back
(``o_proj`` and ``down_proj`` are zero), and its output head maps each token to a chosen successor, so it writes a
fixed script after the prompt's last token (``\\n`` -> ``<think>Let me think</think>\\n\\nHi there!<|im_end|>``).
Its ByteLevel BPE tokenizer has whole-word tokens for the script, and its chat templates are Qwen3's shape (with
``enable_thinking``) and DeepSeek-R1's (the prompt ends inside ``<think>``). The expected split is computed from the
raw greedy tokens of the same model (the runner's batch loop, which does no text assembly), not written by hand.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from mlx_engine.errors import InvalidOptionError, InvalidRequestError
from mlx_engine.models.text.constraint import parse_response_format
from mlx_engine.models.text.reasoning import (HARMONY, HarmonyParser, ReasoningParser, ThinkMarkers, Thinking,
                                         prompt_opens_span, think_markers, think_template_vars)
from mlx_engine.models.generation.runner import Request

REPO = Path(__file__).resolve().parents[1]
MLX_ENGINE = Path(sys.executable).parent / "mlx-engine"
MARKERS = ThinkMarkers("<think>", "</think>")

# ---- the parser ---------------------------------------------------------------------------------------------------


def _parse(chunks, inside=False):
    p = ReasoningParser(MARKERS, inside)
    out = [x for c in chunks for x in p.feed(c)] + p.flush()
    return ("".join(t for k, t in out if k == "thinking"), "".join(t for k, t in out if k == "answer"))


def test_the_parser_splits_alike_wherever_the_stream_is_cut():
    raw = " <think>\n Let me  think.\n</think>\n\nHi <think> there"
    want = ("Let me  think.", "Hi <think> there")  # a marker after the answer began is text
    for i in range(len(raw) + 1):
        for j in range(i, len(raw) + 1):
            assert _parse([raw[:i], raw[i:j], raw[j:]]) == want, (i, j)
    assert _parse(list(raw)) == want


def test_the_parser_cases():
    assert _parse(["Hello <think>x</think>"]) == ("", "Hello <think>x</think>")  # no span at the start: all answer
    assert _parse(["x</think>y"], inside=True) == ("x", "y")  # the prompt opened the span
    assert _parse(["<think>abc"]) == ("abc", "")  # cut off while thinking
    assert _parse(["<think>abc </thi"]) == ("abc </thi", "")  # a partial marker at the end is text
    assert _parse(["<thi"]) == ("", "<thi")
    assert _parse(["  "]) == ("", "")


def test_markers_from_the_template_or_the_vocabulary():
    assert think_markers("{{ '<think>' }}..{{ '</think>' }}", lambda t: None) == MARKERS
    assert think_markers("[THINK] [/THINK]", lambda t: None) == ThinkMarkers("[THINK]", "[/THINK]")
    assert think_markers("plain ChatML", {"<think>": 1, "</think>": 2}.get) == MARKERS
    assert think_markers("plain ChatML", {"<think>": 1}.get) is None
    assert prompt_opens_span("<|im_start|>assistant\n<think>\n", MARKERS)
    assert not prompt_opens_span("<think>\n\n</think>\n\n", MARKERS)
    assert think_template_vars(None) == {}
    assert think_template_vars(False) == {"enable_thinking": False, "thinking": False}
    assert think_template_vars("high")["reasoning_effort"] == "high"


def _harmony(chunks, inside=False):
    p = HarmonyParser(inside)
    out = [x for c in chunks for x in p.feed(c)] + p.flush()
    return ("".join(t for k, t in out if k == "thinking"), "".join(t for k, t in out if k == "answer"))


def test_harmony_channels_split_alike_wherever_the_stream_is_cut():
    """gpt-oss's output after its template's ``<|start|>assistant`` (OpenAI's harmony format): the analysis
    channel's message is the thinking, the final channel's the answer, headers and end markers dropped."""
    raw = ("<|channel|>analysis<|message|>User asks 2+2. Answer 4.<|end|>"
           "<|start|>assistant<|channel|>final<|message|>2 + 2 = 4.<|return|>")
    want = ("User asks 2+2. Answer 4.", "2 + 2 = 4.")
    for i in range(len(raw) + 1):
        for j in range(i, len(raw) + 1, 7):
            assert _harmony([raw[:i], raw[i:j], raw[j:]]) == want, (i, j)
    assert _harmony(list(raw)) == want


def test_harmony_cases():
    assert _harmony(["<|channel|>final<|message|>Hi"]) == ("", "Hi")  # no analysis
    assert _harmony(["Hi <|channel|>"]) == ("", "Hi <|channel|>")  # plain text is the answer, to its end
    assert _harmony(["<|channel|>analysis<|message|>abc <|en"]) == ("abc <|en", "")  # cut off while thinking
    assert _harmony(["abc<|end|><|start|>assistant<|channel|>final<|message|>x"], inside=True) == ("abc", "x")
    # a preamble on the commentary channel (to the user) is answer text
    assert _harmony(["<|channel|>commentary<|message|>Let me check.<|end|>"]) == ("", "Let me check.")
    assert _harmony(["<|channel|>analysis<|mess"]) == ("", "")  # an unfinished header


def test_the_gpt_oss_template_renders_and_selects_harmony():
    """gpt-oss's own chat template (llama.cpp's copy of the released one) renders in our sandbox, with the
    reasoning effort and an earlier answer, ends with the assistant's header, and selects :data:`HARMONY`."""
    from mlx_engine.models.text.chat_template import render_chat_template
    from tests.hf_gguf import llama_cpp_source

    source = (llama_cpp_source() / "models" / "templates" / "openai-gpt-oss-120b.jinja").read_text()
    text = render_chat_template(source, [{"role": "user", "content": "Hi"},
                                         {"role": "assistant", "content": "Hello!"},
                                         {"role": "user", "content": "2+2?"}], reasoning_effort="high")
    assert "Reasoning: high" in text
    assert "<|start|>assistant<|channel|>final<|message|>Hello!<|end|>" in text
    assert text.endswith("<|start|>user<|message|>2+2?<|end|><|start|>assistant")
    assert think_markers(source, lambda t: None) is HARMONY
    assert not prompt_opens_span(text[-64:], HARMONY)


# ---- the scripted model -------------------------------------------------------------------------------------------

QWEN3_STYLE = (
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if message.reasoning_content %}{{- '<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' }}"
    "{%- endif %}{{- message.content + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}{%- endif %}")
R1_STYLE = QWEN3_STYLE.replace("{{- '<|im_start|>assistant\\n' }}{%- if enable", "{{- '<|im_start|>assistant\\n"
                                                                                 "<think>\\n' }}{%- if enable")
WORDS = ["Let", "Ġme", "Ġthink", "Hi", "Ġthere", "ĊĊ"]
SPECIAL = ["<|im_start|>", "<|im_end|>"]
SCRIPT = ["Ċ", "<think>", "Let", "Ġme", "Ġthink", "</think>", "ĊĊ", "Hi", "Ġthere", "!", "<|im_end|>"]


def _tokenizer_json() -> tuple[str, dict[str, int]]:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    from mlx_engine.models.text.tokenizer import bytes_to_unicode

    vocab = {c: i for i, c in enumerate(bytes_to_unicode().values())}
    merges = []
    for w in WORDS:
        for k in range(2, len(w) + 1):
            if w[:k] not in vocab:
                merges.append((w[:k - 1], w[k - 1]))
                vocab[w[:k]] = len(vocab)
    tk = Tokenizer(models.BPE(vocab, merges))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    tk.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<think>", "</think>")])  # as Qwen3's
    return tk.to_str(), {t: tk.token_to_id(t) for t in set(SCRIPT) | set(vocab)}


def make_thinker(folder: Path, template: str) -> Path:
    """The scripted model (see the module docstring) with ``template`` as its chat template."""
    text, ids = _tokenizer_json()
    v = max(ids.values()) + 1
    heads, head_dim = 4, 80
    h = heads * head_dim
    assert h >= v
    nxt = np.full(v, ids["<|im_end|>"])  # every other token ends the answer
    for a, b in zip(SCRIPT, SCRIPT[1:]):
        nxt[ids[a]] = ids[b]
    rng = np.random.default_rng(0)
    w = {"model.embed_tokens.weight": np.eye(v, h, dtype=np.float32), "model.norm.weight": np.ones(h, np.float32),
         "lm_head.weight": np.zeros((v, h), np.float32)}
    w["lm_head.weight"][nxt, np.arange(v)] = 10.0
    p = "model.layers.0."
    for name, shape in (("self_attn.q_proj", (h, h)), ("self_attn.k_proj", (h, h)), ("self_attn.v_proj", (h, h)),
                        ("mlp.gate_proj", (64, h)), ("mlp.up_proj", (64, h))):
        w[p + name + ".weight"] = (rng.standard_normal(shape) * 0.05).astype(np.float32)
    w[p + "self_attn.o_proj.weight"] = np.zeros((h, h), np.float32)  # nothing written back: the output is the
    w[p + "mlp.down_proj.weight"] = np.zeros((h, 64), np.float32)    # head's view of the current token alone
    w[p + "input_layernorm.weight"] = w[p + "post_attention_layernorm.weight"] = np.ones(h, np.float32)
    folder.mkdir(parents=True)
    save_file(w, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": v, "hidden_size": h,
        "num_hidden_layers": 1, "num_attention_heads": heads, "num_key_value_heads": heads, "head_dim": head_dim,
        "intermediate_size": 64, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 2048,
        "tie_word_embeddings": False}))
    (folder / "tokenizer.json").write_text(text)
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|im_end|>", "add_bos_token": False, "chat_template": template}))
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("thinkers")
    return {"qwen3": make_thinker(root / "qwen3", QWEN3_STYLE), "r1": make_thinker(root / "r1", R1_STYLE)}


@pytest.fixture(scope="module")
def models(folders):
    import mlx_engine

    loaded = {k: mlx_engine.load(str(f), progress=False, context_length=256) for k, f in folders.items()}
    yield loaded
    for m in loaded.values():
        m.close()


HELLO = [{"role": "user", "content": "Hello"}]


def expected(model, messages=HELLO, **template_vars) -> tuple[str, str]:
    """``(thinking, answer)`` from the raw greedy tokens (the batch loop: no parsing), split by hand here."""
    tokens = model.chat_tokens(messages) if not template_vars else model.chat_inputs(messages, **template_vars)[0]
    out = model.runner.generate_batch([Request(tokens, max_tokens=64, sequence=1)])[0]
    eos = model.tokenizer.eos_ids
    raw = model.tokenizer.decode([t for t in out if t not in eos])
    inside = prompt_opens_span(model.tokenizer.decode(tokens), MARKERS)
    if "</think>" not in raw:
        return "", raw
    thinking, answer = raw.split("</think>", 1)
    return (thinking if inside else thinking.removeprefix("<think>")).strip(), answer.lstrip()


# ---- the Python API -----------------------------------------------------------------------------------------------


def test_the_api_returns_the_thinking_apart(models):
    m = models["qwen3"]
    assert m.thinks and expected(m) == ("Let me think", "Hi there!")
    reply = m.chat(HELLO)
    assert (reply, reply.thinking) == ("Hi there!", "Let me think")
    pieces = list(m.stream("Hello"))
    assert "".join(p for p in pieces if isinstance(p, Thinking)) == "Let me think"
    assert "".join(p for p in pieces if isinstance(p, str) and not isinstance(p, Thinking)) == "Hi there!"
    last_thinking = max(i for i, p in enumerate(pieces) if isinstance(p, Thinking))
    assert all(not isinstance(p, Thinking) for p in pieces[last_thinking + 1:])  # the thinking comes first
    r = m.respond(HELLO)
    assert (r.content, r.thinking, r.tool_calls) == ("Hi there!", "Let me think", [])


def test_a_prompt_that_opens_the_span(models):
    m = models["r1"]
    assert m.chat_inputs(HELLO)[0][-2:] == [m.tokenizer.token_to_id("<think>"), m.tokenizer.token_to_id("Ċ")]
    want = expected(m)
    assert want == ("<think>Let me think", "Hi there!")  # inside the span, a second <think> is thinking's text
    reply = m.chat(HELLO)
    assert (reply.thinking, reply) == want


def test_think_false_reaches_the_template(models):
    m = models["qwen3"]
    on, off = m.chat_tokens(HELLO), m.chat_inputs(HELLO, **m.template_vars(False))[0]
    assert m.tokenizer.decode(off) == m.tokenizer.decode(on) + "<think>\n\n</think>\n\n"  # as the template says
    reply = m.chat(HELLO, think=False)
    assert (reply, reply.thinking) == (expected(m, enable_thinking=False)[1], "") == ("Hi there!", "")
    with pytest.raises(InvalidOptionError, match="think='much': it must be true, false or one of low"):
        m.chat(HELLO, think="much")


def test_stop_strings_apply_to_the_answer_only(models):
    m = models["qwen3"]
    reply = m.chat(HELLO, stop=["me", "there"])  # "me" is in the thinking: it does not end the request
    assert (reply.thinking, reply) == ("Let me think", "Hi ")


def test_the_grammar_starts_after_the_span(models):
    m = models["qwen3"]
    reply = m.chat(HELLO, regex="[a-z]{3}")
    assert reply.thinking == "Let me think" and len(reply) == 3 and reply.isalpha() and reply.islower()
    r1 = models["r1"].chat(HELLO, regex="[a-z]{3}")  # the prompt opened the span: free text until it closes
    assert r1.thinking == "<think>Let me think" and len(r1) == 3
    fmt = parse_response_format({"type": "regex", "pattern": "[a-z]{3}"})  # the batch loop, its own grammar
    out = m.runner.generate_batch([Request(m.chat_tokens(HELLO), max_tokens=32, sequence=1, response_format=fmt)])[0]
    thinking, answer = m.tokenizer.decode(out).split("</think>")
    assert thinking == "<think>Let me think" and len(answer) == 3 and answer.isalpha()


def test_think_on_a_model_that_does_not_think(smollm2_model):
    assert not smollm2_model.thinks
    with pytest.raises(InvalidRequestError, match="does not think"):
        smollm2_model.chat(HELLO, think=True)
    assert smollm2_model.template_vars(False) == {"enable_thinking": False, "thinking": False}  # accepted, as ollama


def test_a_chat_session_keeps_the_thinking_for_the_template(models, tmp_path):
    m = models["qwen3"]
    chat = m.chat_session()
    assert "".join(p for p in chat.send("Hello") if isinstance(p, str) and not isinstance(p, Thinking)) \
        == "Hi there!"
    assert chat.messages[-1] == {"role": "assistant", "content": "Hi there!", "thinking": "Let me think"}
    chat.messages.append({"role": "user", "content": "Again"})
    rendered = m.tokenizer.decode(m.chat_tokens(chat.messages))
    assert "<|im_start|>assistant\n<think>\nLet me think\n</think>\n\nHi there!<|im_end|>" in rendered
    chat.messages.pop()
    chat.save(tmp_path / "c.json")
    again = m.chat_session()
    again.load(tmp_path / "c.json")
    assert again.messages == chat.messages


# ---- the command line ---------------------------------------------------------------------------------------------


def _cli(*args, env):
    return subprocess.run([str(MLX_ENGINE), *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture
def cli_env(tmp_path):
    return {**os.environ, "MLX_ENGINE_HOME": str(tmp_path / "home"), "OLLAMA_MODELS": str(tmp_path / "none")}


def test_run_piped_puts_only_the_answer_on_stdout(folders, cli_env):
    r = _cli("run", str(folders["qwen3"]), "Hello", env=cli_env)
    assert r.returncode == 0, r.stderr
    assert r.stdout == "Hi there!\n"
    assert "Thinking...\nLet me think\n...done thinking." in r.stderr and "\x1b[" not in r.stderr
    r = _cli("run", str(folders["qwen3"]), "Hello", "--hide-thinking", env=cli_env)
    assert r.stdout == "Hi there!\n" and "Let me think" not in r.stderr
    r = _cli("run", str(folders["qwen3"]), "Hello", "--no-think", env=cli_env)
    assert r.stdout == "Hi there!\n" and "Thinking" not in r.stderr


def _terminal(args, env):
    pexpect = pytest.importorskip("pexpect")
    return pexpect.spawn(str(MLX_ENGINE), args, cwd=str(REPO), env={**env, "TERM": "xterm",
                                                                     "PROMPT_TOOLKIT_NO_CPR": "1"},
                         encoding="utf-8", dimensions=(50, 120), timeout=120)


def test_run_on_a_terminal_shows_the_thinking_dimmed(folders, cli_env):
    pexpect = pytest.importorskip("pexpect")
    child = _terminal(["run", str(folders["qwen3"]), "Hello"], cli_env)
    child.expect(pexpect.EOF)
    out = child.before.replace("\r\n", "\n")
    assert "\x1b[2mThinking...\nLet me think\n...done thinking.\n\n\x1b[0mHi there!\n" in out, repr(out)


def test_chat_on_a_terminal_and_set_nothink(folders, cli_env):
    pexpect = pytest.importorskip("pexpect")
    child = _terminal(["chat", str(folders["qwen3"]), "--no-history"], cli_env)
    try:
        child.expect("Type /\\? for help")
        child.sendline("Hello")
        child.expect("Hi there!")
        turn = child.before
        assert "\x1b[2mThinking..." in turn and "Let me think" in turn
        child.sendline("/set nothink")
        child.expect("Set thinking off.")
        child.sendline("Hello again")
        child.expect("Hi there!")
        assert "Thinking..." not in child.before and "Let me think" not in child.before
        child.sendline("/bye")
        child.expect(pexpect.EOF, timeout=20)
    finally:
        child.close(force=True)


# ---- the server ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(folders, tmp_path_factory):
    from mlx_engine.server import ServerConfig
    from mlx_engine.store import Store
    from mlx_engine.store.manifest import write_manifest
    from tests.test_server import RunningServer, free_port

    root = tmp_path_factory.mktemp("think-home")
    dest = Store(root).model_dir("thinker:test")
    dest.mkdir(parents=True)
    files = []
    for f in folders["qwen3"].iterdir():
        (dest / f.name).symlink_to(f)
        files.append({"name": f.name, "size": f.stat().st_size})
    write_manifest(dest, {"name": "thinker:test", "source": "file", "files": files,
                          "size": sum(f["size"] for f in files), "sha256": None})
    srv = RunningServer(ServerConfig(port=free_port(), models=["thinker:test"], max_sequences=2, context_length=256,
                                     store_root=str(root)))
    yield srv
    srv.stop()


def test_openai_chat_returns_reasoning_content(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    r = client.chat.completions.create(model="thinker:test", messages=HELLO)
    msg = r.choices[0].message
    assert (msg.content, msg.reasoning_content) == ("Hi there!", "Let me think")
    chunks = list(client.chat.completions.create(model="thinker:test", messages=HELLO, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "Let me think"
    assert "".join(d.content or "" for d in deltas) == "Hi there!"
    r = client.chat.completions.create(model="thinker:test", messages=HELLO,  # the scheduler's grammar
                                       extra_body={"response_format": {"type": "regex", "pattern": "[a-z]{3}"}})
    msg = r.choices[0].message
    assert msg.reasoning_content == "Let me think" and len(msg.content) == 3 and msg.content.isalpha()
    for extra in ({"chat_template_kwargs": {"enable_thinking": False}}, {"reasoning_effort": "none"}):
        r = client.chat.completions.create(model="thinker:test", messages=HELLO, extra_body=extra)
        assert (r.choices[0].message.content, r.choices[0].message.reasoning_content) == ("Hi there!", None)
    assert r.usage.prompt_tokens == len(_tokens_of(server, enable_thinking=False))
    history = HELLO + [{"role": "assistant", "content": "Hi there!", "reasoning_content": "Let me think"},
                       {"role": "user", "content": "Again"}]
    r = client.chat.completions.create(model="thinker:test", messages=history)
    tokens = _tokens_of(server, history)  # an earlier turn's reasoning goes back as the template writes it
    assert r.usage.prompt_tokens == len(tokens)
    assert "<think>\nLet me think\n</think>\n\nHi there!" in server.state.pool.models["thinker:test"].obj \
        .tokenizer.decode(tokens)


def _tokens_of(server, messages=HELLO, **template_vars):
    return server.state.pool.models["thinker:test"].obj.chat_inputs(messages, **template_vars)[0]


def test_ollama_returns_thinking_and_think_reaches_the_template(server):
    ollama = pytest.importorskip("ollama")
    client = ollama.Client(host=server.url)
    r = client.chat(model="thinker:test", messages=HELLO)
    assert (r.message.content, r.message.thinking) == ("Hi there!", "Let me think")
    parts = list(client.chat(model="thinker:test", messages=HELLO, stream=True))
    assert "".join(p.message.thinking or "" for p in parts) == "Let me think"
    assert "".join(p.message.content or "" for p in parts) == "Hi there!"
    r = client.chat(model="thinker:test", messages=HELLO, think=False)
    assert (r.message.content, r.message.thinking) == ("Hi there!", None)  # the template closed the span
    g = client.generate(model="thinker:test", prompt="Hello")
    assert (g.response, g.thinking) == ("Hi there!", "Let me think")
    parts = list(client.generate(model="thinker:test", prompt="Hello", stream=True))
    assert "".join(p.thinking or "" for p in parts) == "Let me think"
    assert "".join(p.response or "" for p in parts) == "Hi there!"
    g = client.generate(model="thinker:test", prompt="<|im_start|>assistant\n", raw=True)
    assert g.response == "<think>Let me think</think>\n\nHi there!" and not g.thinking  # raw: the text as written


def test_anthropic_messages_return_thinking_blocks(server):
    anthropic = pytest.importorskip("anthropic")
    client = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
    m = client.messages.create(model="thinker:test", max_tokens=64, messages=HELLO)
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in m.content] == [
        ("thinking", "Let me think"), ("text", "Hi there!")]
    with client.messages.stream(model="thinker:test", max_tokens=64, messages=HELLO) as stream:
        deltas = [e.delta.type for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert "thinking_delta" in deltas and deltas[-1] == "text_delta"
    assert [b.type for b in final.content] == ["thinking", "text"] and final.content[0].thinking == "Let me think"
    m = client.messages.create(model="thinker:test", max_tokens=64, messages=HELLO, thinking={"type": "disabled"})
    assert [(b.type, b.text) for b in m.content] == [("text", "Hi there!")]  # the template closed the span
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == len(_tokens_of(server, enable_thinking=False))
    history = HELLO + [{"role": "assistant", "content": [{"type": "thinking", "thinking": "Let me think",
                                                          "signature": ""}, {"type": "text", "text": "Hi there!"}]},
                       {"role": "user", "content": "Again"}]
    count = client.messages.count_tokens(model="thinker:test", messages=history)
    chat = HELLO + [{"role": "assistant", "content": "Hi there!", "reasoning_content": "Let me think"},
                    {"role": "user", "content": "Again"}]
    assert count.input_tokens == len(_tokens_of(server, chat))  # the thinking goes back as the template writes it


def test_responses_return_a_reasoning_item(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    r = client.responses.create(model="thinker:test", input="Hello")
    assert [o.type for o in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == "Let me think" and r.output_text == "Hi there!"
    assert r.usage.output_tokens_details.reasoning_tokens == 3  # "Let", " me", " think"
    events = list(client.responses.create(model="thinker:test", input="Hello", stream=True))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "Let me think"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Hi there!"
    r = client.responses.create(model="thinker:test", input="Hello", reasoning={"effort": "none"})
    assert [o.type for o in r.output] == ["message"] and r.output_text == "Hi there!"
    r2 = client.responses.create(model="thinker:test", input="Again", previous_response_id=r.id)
    chat = HELLO + [{"role": "assistant", "content": "Hi there!"}, {"role": "user", "content": "Again"}]
    assert r2.usage.input_tokens == len(_tokens_of(server, chat))
