"""Every fenced example of the README and of the pages under ``docs/`` runs in a test, so that the documentation
cannot go stale.

The ``sh`` blocks are split into commands and the ``python`` blocks taken whole (:mod:`tests.doc_examples`);
:data:`COVERAGE` says for each where it runs: in a test of this module (the command as written, by the installed
``mlx-engine``, against a store holding the real catalog models and an ollama registry on loopback), in a test of
another module (named, and checked to exist), or why it cannot run here (the Hugging Face hub, a 20 GB Z-Image
folder). An example that no entry covers fails :func:`test_every_readme_example_has_a_test`, naming its file. The
README repeats some examples of the docs pages; each distinct one runs once.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import link_model
from tests.doc_examples import REPO, blocks, commands, distinct, examples, unknown_fences

BIN = Path(sys.executable).parent  # this environment's mlx-engine and python

#: (pattern of a command or of a python block's text, where it runs): ``here:TEST`` (this module),
#: ``elsewhere:FILE::TEST`` (another module), ``ci:WHY`` (what .ci/run itself does), ``not run:WHY``. First match wins.
COVERAGE: list[tuple[str, str]] = [
    (r"^python3 -m venv \.venv && \.venv/bin/pip install -e \. && \.venv/bin/mlx-engine run ", "here:test_start_here"),
    (r'^python3 -m venv \.venv && \.venv/bin/pip install -e "\.\[test\]" && \.venv/bin/python -m pytest$',
     "ci:.ci/run makes a fresh environment, installs .[test] and runs this very test command"),
    (r"^mlx-engine run .* --(format|json-schema|regex|grammar) ", "here:test_structured_output_examples"),
    (r"^mlx-engine run \./gemma-3-4b-it .* --image ", "elsewhere:tests/test_vision.py::test_the_cli_reads_images (the "
                                                    "same command on a small random Gemma 3 vision folder; the "
                                                    "real one is an 8 GB download from the hub)"),
    (r"^mlx-engine run \./Llama-3\.1-8B.* --draft-model ", "not run:needs Llama 3.1 8B and 3.2 1B GGUF files (a "
                                                          "download); a draft model runs in tests/"
                                                          "test_speculative_draft.py"),
    (r"^mlx-engine run .* --speculative ", "here:test_speculative_examples"),
    (r"^mlx-engine embed \./all-MiniLM-L6-v2 ", "elsewhere:tests/test_embeddings.py::test_doc_examples (the commands as "
                                                "written, ./all-MiniLM-L6-v2 a small random folder in its layout)"),
    (r"mlx_engine\.load\(\"\./all-MiniLM-L6-v2\"\)", "elsewhere:tests/test_embeddings.py::test_doc_examples"),
    (r"^(echo .* \| )?mlx-engine run ", "here:test_run_examples"),
    (r"^mlx-engine chat\b", "here:test_chat_examples"),
    (r"^mlx-engine pull hf:", "not run:needs the Hugging Face hub (the download code is tested against a fake hub in "
                              "tests/test_store.py::test_hf_models_download_once_into_the_store)"),
    (r"^mlx-engine (pull|list|show|rm)\b", "here:test_store_examples"),
    (r"^mlx-engine verify\b", "here:test_verify_examples"),
    (r"^mlx-engine image .*(-m|--model) \./z-image", "not run:needs a Z-Image folder (about 20 GB from the Hugging "
                                                     "Face hub); the pipeline runs on a small random Z-Image folder "
                                                     "in tests/test_cli_image.py"),
    (r"^mlx-engine image ", "elsewhere:tests/test_shapes_model.py::test_readme_image_commands_run_as_written"),
    (r"^python -m training\.", "elsewhere:tests/test_shapes_model.py::test_short_training_runs_lower_the_loss "
                               "(every stage on a few steps; the full run takes 80 minutes)"),
    (r"^(MLX_ENGINE_ORIGINS|MLX_ENGINE_ALLOWED_HOSTS)=|^mlx-engine serve --(allowed-origins|allowed-hosts|models-dir) ",
     "here:test_security_examples"),
    (r'^curl http://127\.0\.0\.1:11435/api/generate .*"\$HOME"', "here:test_security_examples"),
    (r"^mlx-engine serve --model \./no-such-model\.gguf", "here:test_server_errors_examples"),
    (r"^python benchmarks/soak\.py ", "elsewhere:tests/test_server_robust.py::test_the_soak_benchmark_runs (the same "
                                      "script for a quarter of a minute; the documented run takes 30 minutes)"),
    (r"^python -m benchmarks\.speculative ", "elsewhere:tests/test_bench_speculative.py::"
                                             "test_the_speculative_bench_beside_llama_cpp (the same measurement at "
                                             "tiny sizes; the documented run takes most of an hour here)"),
    (r"^(MLX_ENGINE_API_KEY=\S+ )?mlx-engine serve\b", "here:test_serve_examples"),
    (r"^curl http://127\.0\.0\.1:11435/", "here:test_serve_examples"),
    (r"^mlx-engine bench --quick$", "here:test_bench_quick"),
    (r"^mlx-engine bench ", "elsewhere:tests/test_bench.py::test_quick_json_has_every_figure (the same command with "
                            "both peers at --quick sizes; the full sizes take minutes: the bench is not a test)"),
    (r"anthropic\.Anthropic\(base_url=|client\.responses\.create\(",
     "elsewhere:tests/test_server_agent_apis.py::test_the_docs_examples_run (against that module's server)"),
    (r"top_logprobs=2|text_string_to_metric_families",
     "elsewhere:tests/test_server_ops.py::test_the_docs_examples_run (against that module's server)"),
    (r"openai\.OpenAI\(base_url=\"http://127\.0\.0\.1:11435/v1\"", "here:test_serve_examples"),
    (r"^mlx\.launch -n \d --backend ring -- mlx-engine run ", "here:test_parallel_examples"),
    (r"^mlx\.launch --hosts ", "not run:needs two Macs with this engine installed and ssh between them (the same "
                               "ranks run on loopback in tests/test_distributed.py)"),
    (r"^mlx\.distributed_config |^mlx\.launch --hostfile \S+ --backend jaccl ",
     "not run:needs two Macs joined by Thunderbolt with RDMA enabled"),
    (r"parallel=\"pipeline\"", "here:test_parallel_examples"),
    (r"speculative=\"lookup\"", "here:test_speculative_examples"),
    (r"mlx_engine\.load\(\"smollm2:135m\"\)", "here:test_python_api_example"),
    (r"print\(reply\.thinking\)", "elsewhere:tests/test_reasoning.py::test_the_api_returns_the_thinking_apart (the "
                                  "same calls on a small random reasoning model; qwen3:0.6b is a download)"),
    (r"mlx_engine\.generate_image\(", "elsewhere:tests/test_shapes_model.py::test_readme_python_image_example"),
]


def where(text: str) -> str | None:
    return next((w for pattern, w in COVERAGE if re.search(pattern, text)), None)


def covered(test: str) -> list[str]:
    """The distinct examples that :data:`COVERAGE` sends to ``test`` of this module, in file order."""
    return distinct([e for _, e in examples() if where(e) == f"here:{test}"])


def test_every_readme_example_has_a_test():
    """Every example of README.md and docs/**/*.md has a COVERAGE entry whose test exists (or a reason it cannot
    run here), and every entry still matches an example."""
    found = examples()
    assert len(found) > 30
    assert not unknown_fences(), ("fenced blocks must be sh or python (examples), or unlabelled or text (sample "
                                  f"output): {unknown_fences()}")
    uncovered = [f"{file}: {e}" for file, e in found if where(e) is None]
    assert not uncovered, f"examples without a test (add them to COVERAGE in tests/test_readme.py): {uncovered}"
    here = set(globals())
    for file, e in found:
        kind, _, target = where(e).partition(":")
        if kind == "here":
            assert target in here, (file, e, target)
        elif kind == "elsewhere":
            path, _, test = target.split(" ", 1)[0].partition("::")
            assert f"def {test}(" in (REPO / path).read_text(), (file, e, target)
        else:
            assert kind in ("ci", "not run") and len(target) > 20, (file, e, target)
    # and the other way: every pattern still matches some example
    unused = [p for p, _ in COVERAGE if not any(re.search(p, e) for _, e in found)]
    assert not unused, f"COVERAGE entries that match no example any more: {unused}"


def test_the_docs_pages_are_linked():
    """docs/index.md lists every page under docs/; the README, kept short, links the index and security.md."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    index = (REPO / "docs" / "index.md").read_text(encoding="utf-8")
    pages = sorted(p.relative_to(REPO / "docs").as_posix() for p in (REPO / "docs").rglob("*.md"))
    assert len(readme.splitlines()) <= 320
    unlisted = [p for p in pages if p != "index.md" and f"]({p})" not in index]
    assert not unlisted, f"pages that docs/index.md does not list: {unlisted}"
    assert "](docs/index.md)" in readme and "](docs/security.md)" in readme and "](security.md)" in index


# ---------------------------------------------------------------------------------------------- running them

@pytest.fixture
def readme_home(tmp_path, smollm2_gguf, gemma3_gguf):
    """A store with both catalog models (linked), no ollama store, an ollama registry on loopback that serves the
    real smollm2 GGUF under ollama's names; the environment and working folder the commands run in."""
    from tests.test_store_registry import Registry

    home = tmp_path / "home"
    home.mkdir()
    link_model(smollm2_gguf.parent, home)
    link_model(gemma3_gguf.parent, home)
    registry = Registry(smollm2_gguf)
    registry.extra.add("llama3.2")  # the README's ollama name
    cwd = tmp_path / "work"
    cwd.mkdir()
    env = {**os.environ, "MLX_ENGINE_HOME": str(home), "OLLAMA_MODELS": str(tmp_path / "no-ollama"),
           "MLX_ENGINE_OLLAMA_REGISTRY": registry.url, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("MLX_ENGINE_API_KEY", None)
    yield home, cwd, env
    registry.close()


def sh(command: str, cwd: Path, env: dict, input: str | None = None,
       timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``command`` with bash as a user would; it must succeed without a traceback."""
    r = subprocess.run(["bash", "-c", command], cwd=cwd, env=env, input=input, capture_output=True, text=True,
                       timeout=timeout)
    assert r.returncode == 0, (command, r.stdout[-2000:], r.stderr[-2000:])
    assert "Traceback" not in r.stderr, (command, r.stderr)
    return r


def test_start_here(readme_home):
    """The first command's answer (the set-up part is what .ci/run does, in a fresh environment)."""
    home, cwd, env = readme_home
    first = next(commands(b.text)[0] for b in blocks("sh") if b.file == "README.md" and b.heading == "Start here")
    r = sh(first.rsplit(" && ", 1)[1].replace(".venv/bin/", ""), cwd, env)
    assert "Paris" in r.stdout


def test_run_examples(readme_home, smollm2_gguf):
    home, cwd, env = readme_home
    (cwd / "models").mkdir()
    (cwd / "models" / "my-model.gguf").symlink_to(smollm2_gguf)  # the docs' "your own GGUF file"
    cmds = covered("test_run_examples")
    assert len(cmds) == 5
    outs = {c: sh(c, cwd, env) for c in cmds}
    assert "Paris" in outs['mlx-engine run "What is the capital of France?"'].stdout
    assert all(o.stdout.strip() for o in outs.values()), [o.stdout for o in outs.values()]
    verbose = [o for c, o in outs.items() if c.endswith(" --verbose")]
    assert verbose and all("decode" in o.stderr and "mlx cpu" in o.stderr for o in verbose)  # the device, the speed


def test_speculative_examples(readme_home, monkeypatch, capsys):
    """docs/speculative.md's command (the sentence repeated, with the acceptance in the --verbose summary) and its
    Python block (an answer)."""
    home, cwd, env = readme_home
    cmds = [c for c in covered("test_speculative_examples") if c.startswith("mlx-engine ")]
    assert len(cmds) == 1
    out = sh(cmds[0], cwd, env)
    assert "quick brown fox" in out.stdout and "accepted" in out.stderr, (out.stdout, out.stderr)
    block = next(b.text for b in blocks("python") if where(b.text) == "here:test_speculative_examples")
    monkeypatch.chdir(cwd)
    for key in ("MLX_ENGINE_HOME", "OLLAMA_MODELS"):
        monkeypatch.setenv(key, env[key])
    exec(compile(block, "docs/speculative.md", "exec"), {})
    assert "cat" in capsys.readouterr().out.lower()


def test_server_errors_examples(readme_home):
    """docs/server-errors.md's start-up failure: one ``Error:`` line naming the file, exit status 1."""
    home, cwd, env = readme_home
    cmds = covered("test_server_errors_examples")
    assert len(cmds) == 1
    out = sh(cmds[0], cwd, env)
    assert out.stdout.strip().endswith("exit 1") and "Error:" in out.stderr and "no-such-model" in out.stderr, out


def test_structured_output_examples(readme_home):
    """The structured-output commands, with the schema and grammar files they name (the grammar as the comment
    gives it)."""
    import jsonschema

    home, cwd, env = readme_home
    cmds = covered("test_structured_output_examples")
    assert [re.search(r" --(format|json-schema|regex|grammar) ", c).group(1) for c in cmds] == [
        "format", "json-schema", "regex", "grammar"]
    person = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                               "age": {"type": "integer"}}, "required": ["name", "age"]}
    (cwd / "person.json").write_text(json.dumps(person))
    grammar = next(mo.group(1) for b in blocks("sh") if (mo := re.search(r"(root ::= .*)$", b.text, re.M)))
    (cwd / "yes-no.gbnf").write_text(grammar + "\n")
    outs = [sh(c, cwd, env).stdout.strip() for c in cmds]
    assert isinstance(json.loads(outs[0]), dict)
    jsonschema.validate(json.loads(outs[1]), person)
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", outs[2]) and outs[3] in ("yes", "no")


def test_chat_examples(readme_home):
    """Both chat commands, fed the documented transcript (its ``>>>`` and ``...`` lines) through a pipe."""
    home, cwd, env = readme_home
    transcripts = distinct([b.text for b in blocks("") if ">>> " in b.text])
    assert len(transcripts) == 1  # the README's and commands.md's are the same
    transcript = transcripts[0]
    typed = [line[4:] for line in transcript.splitlines() if line.startswith((">>> ", "... "))]
    assert typed[0] == "What is the capital of France?" and typed[-1] == '"""'
    cmds = covered("test_chat_examples")
    assert len(cmds) == 2 and "--system" in cmds[1]
    r = sh(cmds[0], cwd, env, input="\n".join(typed + ["/show", "/bye"]) + "\n")
    assert "Paris" in r.stdout and "Set temperature to 0.8." in r.stdout
    assert "Conversation: 2 messages from you" in r.stdout  # the multiline message was one message
    r = sh(cmds[1], cwd, env, input="Who are you?\n/show\n/bye\n")
    assert "System prompt: You are a pirate." in r.stdout and "temperature=0.7" in r.stdout


def test_store_examples(readme_home):
    """pull (a catalog name, an ollama name from the loopback registry), list, list --catalog, show, rm; and the
    documented sample output of ``list`` is what ``list`` prints."""
    home, cwd, env = readme_home
    sample = next(b.text for b in blocks("") if "$ mlx-engine list" in b.text)
    assert sh("mlx-engine list", cwd, env).stdout.split() == sample.split()[3:]
    order = ["pull", "list", "show", "rm"]  # the store's life: rm last
    cmds = sorted(covered("test_store_examples"), key=lambda c: order.index(c.split()[1]))
    assert [c.split()[1] for c in cmds] == ["pull", "pull", "list", "list", "show", "show", "rm"]
    outs = {c: sh(c, cwd, env) for c in cmds}
    assert "llama3.2:latest" in outs["mlx-engine list"].stdout  # pulled from the registry by its ollama name
    assert "ollama-registry" in outs["mlx-engine list"].stdout
    assert "pulling llama3.2 from ollama's registry" in outs["mlx-engine pull llama3.2"].stderr
    assert "smollm2:135m" in outs["mlx-engine list --catalog"].stdout
    assert "architecture" in outs["mlx-engine show smollm2:135m"].stdout
    assert "<|im_start|>" in outs["mlx-engine show smollm2:135m --template"].stdout
    assert "gemma3:270m" not in sh("mlx-engine list", cwd, env).stdout  # rm removed it


def test_verify_examples(readme_home):
    """verify, of every pulled model and of one, as docs/security.md writes them: each file checked, all ok."""
    home, cwd, env = readme_home
    cmds = covered("test_verify_examples")
    assert sorted(cmds) == ["mlx-engine verify", "mlx-engine verify smollm2:135m"]
    every = sh("mlx-engine verify", cwd, env).stdout
    assert "smollm2:135m" in every and "gemma3:270m" in every and "MISMATCH" not in every, every
    one = sh("mlx-engine verify smollm2:135m", cwd, env).stdout
    assert "ok" in one and "smollm2:135m" in one and "gemma3:270m" not in one, one


def _free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


class Served:
    """A README ``serve`` command running as written (bash runs a lone command in its own process, so the signal
    reaches the server), until :meth:`stop` (Ctrl-C, as the README says)."""

    def __init__(self, command: str, cwd: Path, env: dict):
        if not _free(11435):
            pytest.fail("port 11435, the README's, is in use by another program: stop it to run this test")
        self.proc = subprocess.Popen(["bash", "-c", command], cwd=cwd, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 180
        while _free(11435):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"{command} did not start: {self.stderr[-2000:]}")
            time.sleep(0.2)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            _, self.stderr = self.proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, self.stderr = self.proc.communicate()
        return self.proc.returncode


def test_serve_examples(readme_home, capsys):
    """The three serve commands as written (port 11435), the curl commands and the client snippet against the first,
    both models of the second, the API key of the third."""
    home, cwd, env = readme_home
    serve = [c for c in covered("test_serve_examples") if " serve" in c]
    curls = [c for c in covered("test_serve_examples") if c.startswith("curl ")]
    assert len(serve) == 3 and len(curls) == 3
    client = next(b.text for b in blocks("python") if "openai.OpenAI" in b.text)
    base = "http://127.0.0.1:11435"

    s = Served(serve[0], cwd, env)
    try:
        for c in curls:
            r = sh(c + " --fail --silent --show-error", cwd, env)
            last = json.loads(r.stdout.strip().splitlines()[-1])  # ollama streams NDJSON: the last line sums up
            assert last.get("choices") or last.get("done") or last.get("data"), r.stdout[:300]
        exec(compile(client, "docs/server.md", "exec"), {})
        assert "Hello" in capsys.readouterr().out
    finally:
        assert s.stop() in (0, 130), s.stderr[-2000:]

    s = Served(serve[1], cwd, env)
    try:
        models = {m["id"] for m in httpx.get(base + "/v1/models").json()["data"]}
        assert {"smollm2:135m", "shapes:64"} <= models
        status = httpx.get(base + "/status").json()
        assert status["models"]["smollm2:135m"]["slots"] == 8, status  # --max-sequences 8
    finally:
        assert s.stop() in (0, 130), s.stderr[-2000:]

    s = Served(serve[2], cwd, env)
    try:
        assert httpx.get(base + "/v1/models").status_code == 401
        assert httpx.get(base + "/v1/models", headers={"Authorization": "Bearer secret"}).status_code == 200
    finally:
        assert s.stop() in (0, 130), s.stderr[-2000:]


def test_security_examples(readme_home):
    """docs/security.md's serve commands as written: the origins and hosts they name are answered (and others
    refused), and a model under --models-dir is served by its path (the curl command as written)."""
    home, cwd, env = readme_home
    serve = [c for c in covered("test_security_examples") if " serve" in c]
    curl = next(c for c in covered("test_security_examples") if c.startswith("curl "))
    base = "http://127.0.0.1:11435"
    assert len(serve) == 5
    user = cwd.parent / "user"  # the user's $HOME, where ~/models is
    (user / "models").mkdir(parents=True)
    env = {**env, "HOME": str(user)}
    # a copy: a link pointing out of --models-dir is refused, as the page says
    shutil.copyfile(next(p for p in home.rglob("*.gguf") if "smollm2" in str(p).lower()).resolve(),
                    user / "models" / "my.gguf")
    for command in serve:
        s = Served(command, cwd, env)
        try:
            if "ORIGINS" in command or "allowed-origins" in command:
                ok = httpx.get(base + "/api/tags", headers={"Origin": "https://chat.example.com"})
                assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "https://chat.example.com"
                assert httpx.get(base + "/api/tags", headers={"Origin": "https://evil.example"}).status_code == 403
            elif "HOSTS" in command or "allowed-hosts" in command:
                assert httpx.get(base + "/api/tags", headers={"Host": "myserver.lan:11435"}).status_code == 200
                assert httpx.get(base + "/api/tags", headers={"Host": "attacker.example"}).status_code == 403
            else:
                r = sh(curl + " --fail --silent --show-error", cwd, env)
                assert json.loads(r.stdout.strip().splitlines()[-1])["done"], r.stdout[-300:]
        finally:
            assert s.stop() in (0, 130), s.stderr[-2000:]


def test_bench_quick(readme_home):
    home, cwd, env = readme_home
    r = sh(next(c for c in covered("test_bench_quick") if "--quick" in c), cwd, env)
    assert "decode" in r.stdout and "smollm2:135m" in r.stdout


def test_python_api_example(readme_home, monkeypatch, capsys):
    """The README's short Python example and docs/python-api.md's whole one, each as written."""
    home, cwd, env = readme_home
    found = [(b.file, b.text) for b in blocks("python") if where(b.text) == "here:test_python_api_example"]
    assert {file for file, _ in found} == {"README.md", "docs/python-api.md"}
    monkeypatch.chdir(cwd)
    for key in ("MLX_ENGINE_HOME", "OLLAMA_MODELS"):
        monkeypatch.setenv(key, env[key])
    for file, block in found:
        exec(compile(block, file, "exec"), {})
        out = capsys.readouterr().out
        assert "Paris" in out and "decode" in out, (file, out)  # an answer, and the stats' summary
    saved = json.loads((cwd / "conversation.json").read_text())  # python-api.md's chat session
    assert [m["role"] for m in saved["messages"]] == ["system", "user", "assistant"]


def test_parallel_examples(readme_home):
    """The trial commands under mlx.launch on this machine (two and three ranks on loopback), and the Python block
    as a script under mlx.launch: each prints what one process prints."""
    home, cwd, env = readme_home
    cmds = [c for c in covered("test_parallel_examples") if c.startswith("mlx.launch ")]
    assert len(cmds) == 2
    for c in cmds:
        alone = re.sub(r" --parallel \w+", "", c.split(" -- ", 1)[1])
        assert sh(c, cwd, env, input="").stdout.strip() == sh(alone, cwd, env).stdout.strip() != ""
    block = next(b.text for b in blocks("python") if 'parallel="pipeline"' in b.text)
    (cwd / "script.py").write_text(block)
    (cwd / "alone.py").write_text(block.replace(', parallel="pipeline"', ""))
    got = sh("mlx.launch -n 2 --backend ring -- python script.py", cwd, env, input="")
    assert got.stdout.strip() == sh("python alone.py", cwd, env).stdout.strip() != ""
