"""One model over several ranks (``mx.distributed``'s ring on loopback): the plans, and real runs of 2 and 3 ranks
of both real models in pipeline and tensor parallelism against one process; faults.

The ranks are started here the way ``mlx.launch`` starts them (``MLX_RANK`` and a ``MLX_HOSTFILE`` of loopback
ports), so that a test can kill one of them; one test goes through ``mlx.launch`` itself.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from mlx_engine.errors import InvalidRequestError, UnsupportedError
from mlx_engine.models.layers.config import DecoderConfig
from mlx_engine.models.layers.sharding import _split_heads, _stages, plan
from mlx_engine.models.registry import file_config
from mlx_engine.weights import QuantizedArray, open_weights
from mlx_engine.weights.quant import quantize_affine

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


# ---- plans ------------------------------------------------------------------------------------------------------
def _config(heads: int, kv: int, layers: int = 4) -> DecoderConfig:
    return DecoderConfig("llama", 100, 64, layers, heads, kv, 16, 128, 1e-5, 64)


@pytest.mark.parametrize("heads,kv,size", [(9, 3, 2), (9, 3, 3), (4, 1, 2), (4, 1, 3), (8, 2, 4), (8, 8, 3),
                                           (6, 2, 3), (12, 4, 5)])
def test_head_split_covers_every_head_once_with_its_key_value_head(heads, kv, size):
    c = _config(heads, kv)
    rep = heads // kv
    seen = []
    for rank in range(size):
        (h0, h1), (k0, k1) = _split_heads(c, rank, size)
        assert h1 > h0 and k1 > k0
        assert (h1 - h0) % (k1 - k0) == 0  # a whole number of query heads per local key/value head
        local_rep = (h1 - h0) // (k1 - k0)
        for j in range(h0, h1):  # query head j's own key/value head is the local one it attends with
            assert j // rep == k0 + (j - h0) // local_rep
        seen += range(h0, h1)
    assert seen == list(range(heads))


def test_head_split_refuses_more_ranks_than_heads():
    with pytest.raises(UnsupportedError, match="at least 5 attention heads"):
        _split_heads(_config(4, 1), 0, 5)


def test_stages_minimise_the_largest_and_cover_every_layer():
    rng = np.random.default_rng(0)
    for _ in range(30):
        n, size = int(rng.integers(3, 9)), int(rng.integers(2, 4))
        sizes = [int(x) for x in rng.integers(1, 100, n)]
        last = int(rng.integers(0, 150))
        got = _stages(sizes, last, size)
        assert [i for r in got for i in r] == list(range(n)) and all(len(r) for r in got)

        def cost(stages):
            return max(sum(sizes[i] for i in r) + (last if s == size - 1 else 0) for s, r in enumerate(stages))
        best = min(cost([range(a, b) for a, b in zip((0,) + cuts, cuts + (n,))])
                   for cuts in itertools.combinations(range(1, n), size - 1))
        assert cost(got) == best


@pytest.mark.parametrize("bits", [4, 5, 8])
def test_quantized_slices_equal_slices_of_the_dequantized_weight(bits):
    w = np.random.default_rng(bits).standard_normal((12, 128)).astype(np.float32)
    q = quantize_affine(w, bits)
    full = q.dequantize()
    np.testing.assert_array_equal(q.slice(0, 3, 9).dequantize(), full[3:9])
    np.testing.assert_array_equal(q.slice(1, 32, 96).dequantize(), full[:, 32:96])
    assert isinstance(q.slice(1, 64, 128), QuantizedArray)
    with pytest.raises(ValueError, match="cut a quantization group"):
        q.slice(1, 16, 64)
    with pytest.raises(ValueError, match="out of"):
        q.slice(0, 5, 13)


@pytest.mark.parametrize("mode,size", [("pipeline", 2), ("pipeline", 3), ("tensor", 2), ("tensor", 3)])
def test_plans_of_the_real_files_share_out_every_tensor(smollm2_gguf, gemma3_gguf, mode, size):
    for path in (smollm2_gguf, gemma3_gguf):
        with open_weights(path) as wf:
            plans = [plan(wf, file_config(wf), mode, r, size) for r in range(size)]
            cuts = [p.tensors(wf) for p in plans]
            layer_names = [n for n in wf.names() if n.startswith("blk.")]
            if mode == "pipeline":  # every layer tensor on exactly one rank, whole
                for n in layer_names:
                    assert sum(n in c for c in cuts) == 1 and all(c.get(n) is None for c in cuts if n in c)
                assert "token_embd.weight" in cuts[0] and all("token_embd.weight" not in c for c in cuts[1:])
            else:  # every q row and every MLP column on exactly one rank
                q = "blk.0.attn_q.weight"
                rows = sorted((range(c[q][1], c[q][2]) for c in cuts), key=lambda r: r.start)
                assert [i for r in rows for i in r] == list(range(wf.shape(q)[0]))
                down = "blk.0.ffn_down.weight"
                cols = sorted((range(c[down][1], c[down][2]) for c in cuts), key=lambda r: r.start)
                assert [i for r in cols for i in r] == list(range(wf.shape(down)[1]))
                assert all(c[down][0] == 1 and c["blk.0.attn_output.weight"][0] == 1 for c in cuts)
        with pytest.raises(InvalidRequestError, match="unknown parallel mode"):
            plan(wf, file_config(wf), "data", 0, size)


def test_fingerprints_tell_files_apart(smollm2_gguf, gemma3_gguf):
    with open_weights(smollm2_gguf) as a, open_weights(gemma3_gguf) as b, open_weights(smollm2_gguf) as c:
        assert a.fingerprint() == c.fingerprint() != b.fingerprint()


# ---- real runs --------------------------------------------------------------------------------------------------
def _hostfile(tmp: Path, size: int) -> Path:
    ports = []
    socks = []
    for _ in range(size):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    f = tmp / f"hosts-{size}-{ports[0]}.json"
    f.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in ports]))
    return f


def _env(rank: int, hostfile: Path) -> dict[str, str]:
    return {**os.environ, "MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile), "PYTHONPATH": str(REPO),
            "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}


def _launch(tmp: Path, commands: list[list[str]], **kw) -> list[subprocess.Popen]:
    hostfile = _hostfile(tmp, len(commands))
    return [subprocess.Popen(cmd, env=_env(r, hostfile), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             **kw) for r, cmd in enumerate(commands)]


def _finish(procs: list[subprocess.Popen], timeout: float = 240) -> list[tuple[int, str, str]]:
    out = []
    for p in procs:
        try:
            o, e = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        out.append((p.returncode, o, e))
    return out


def _worker(path: Path, mode: str, out: Path) -> list[str]:
    return [sys.executable, "-m", "tests.distributed_worker", str(path), mode, str(out)]


@pytest.fixture(scope="module")
def single_runs(tmp_path_factory, smollm2_gguf, gemma3_gguf) -> dict[str, dict]:
    tmp = tmp_path_factory.mktemp("single")
    runs = {}
    for name, path in (("smollm2", smollm2_gguf), ("gemma3", gemma3_gguf)):
        out = tmp / f"{name}.json"
        subprocess.run(_worker(path, "single", out), check=True, env={**os.environ, "PYTHONPATH": str(REPO)},
                       timeout=300)
        runs[name] = json.loads(out.read_text())
    return runs


# Each model under both modes and both sizes, each mode at both sizes on both models: four runs, not all eight (a
# run is a minute or two of CI). smollm2's 9 heads over 2 ranks is an uneven head split; gemma3's one key/value head
# over 3 ranks is shared by all three.
@pytest.mark.parametrize("model,mode,size", [("gemma3", "pipeline", 2), ("smollm2", "tensor", 2),
                                             ("smollm2", "pipeline", 3), ("gemma3", "tensor", 3)])
def test_ranks_give_the_tokens_and_logits_of_one_process(tmp_path, request, single_runs, model, mode, size):
    path = request.getfixturevalue(f"{model}_gguf")
    out = tmp_path / "rank0.json"
    results = _finish(_launch(tmp_path, [_worker(path, mode, out)] * size))
    for rank, (code, _, err) in enumerate(results):
        assert code == 0, f"rank {rank} exited {code}: {err[-2000:]}"
    got, want = json.loads(out.read_text()), single_runs[model]
    for g, w in zip(got["prompts"], want["prompts"]):
        assert g["tokens"] == w["tokens"]
        gl, wl = np.array(g["logits"]), np.array(w["logits"])
        assert np.max(np.abs(gl - wl)) <= 1e-4 * np.max(np.abs(wl))
    assert got["chat"] == want["chat"]  # same answers, and each turn prefilled only what is new
    assert all(t["prefilled"] < t["prompt"] for t in got["chat"][1:])
    ranks = got["ranks"]
    assert [r["rank"] for r in ranks] == list(range(size))
    whole = want["ranks"][0]["weights_bytes"]
    share = [r["weights_bytes"] / whole for r in ranks]
    # each rank holds its share of the layers, plus the embeddings and head where it needs them (a rank holds at
    # most both); the split follows bytes and heads, so a share may pass 1/size by a little
    with open_weights(path) as wf:
        total = sum(wf.nbytes(n) for n in wf.names())
        shared = sum(wf.nbytes(n) for n in ("token_embd.weight", "output.weight") if n in wf.names()) / total
    limit = shared + (1 - shared) / size * 1.25
    assert max(share) <= limit, (share, limit)
    if mode == "pipeline":
        layers = sorted(tuple(r["layers"]) for r in ranks)
        assert layers[0][0] == 0 and all(a[1] == b[0] for a, b in zip(layers, layers[1:]))


def test_a_rank_of_another_file_is_refused_at_start(tmp_path, smollm2_gguf, gemma3_gguf):
    procs = _launch(tmp_path, [_worker(smollm2_gguf, "pipeline", tmp_path / "a.json"),
                               _worker(gemma3_gguf, "pipeline", tmp_path / "b.json")])
    for code, _, err in _finish(procs, timeout=120):
        assert code != 0
        assert "rank 1 of the distributed run differs from rank 0: fingerprint" in err
    assert not (tmp_path / "a.json").exists()


def _cli(*args: str) -> list[str]:
    return [str(BIN / "mlx-engine"), *args]


@pytest.mark.parametrize("victim", [1, 0])
def test_a_killed_rank_stops_the_others_with_a_clear_message(tmp_path, smollm2_gguf, victim):
    # a raw count goes on for all 2000 tokens (an instruct answer may end before the kill)
    cmd = _cli("run", str(smollm2_gguf), "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,", "--raw", "--max-tokens", "2000",
               "--temperature", "0", "--parallel", "pipeline", "--transport", "ring")
    procs = _launch(tmp_path, [cmd, cmd], bufsize=0)
    first = procs[0].stdout.read(1)  # rank 0 has streamed its first character: generation is under way
    assert first, procs[0].stderr.read()
    assert all(p.poll() is None for p in procs), "a rank ended before the kill"
    procs[victim].send_signal(signal.SIGKILL)
    survivor = procs[1 - victim]
    t0 = time.monotonic()
    _, err = survivor.communicate(timeout=30)
    took = time.monotonic() - t0
    procs[victim].wait()
    assert survivor.returncode == 1, err
    assert "another rank of the distributed run is gone" in err and "Traceback" not in err
    assert took < 10, f"the survivor took {took:.1f} s to stop"


def test_mlx_launch_runs_the_cli_on_two_ranks(smollm2_gguf, single_runs):
    cmd = [str(BIN / "mlx.launch"), "-n", "2", "--backend", "ring", "--", str(BIN / "mlx-engine"), "run",
           str(smollm2_gguf), "The capital of France is", "--raw", "--max-tokens", "8", "--temperature", "0",
           "--parallel", "tensor"]
    single = subprocess.run(cmd[cmd.index("--") + 1:-2], capture_output=True, text=True, timeout=120)
    got = subprocess.run(cmd, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert single.returncode == 0 and got.returncode == 0, got.stderr
    assert got.stdout.strip() == single.stdout.strip() != ""


def test_parallel_alone_is_refused_with_how_to_launch(smollm2_gguf):
    import mlx_engine

    with pytest.raises(InvalidRequestError, match="mlx.launch -n 2"):
        mlx_engine.load(str(smollm2_gguf), progress=False, parallel="pipeline")
    with pytest.raises(InvalidRequestError, match="unknown parallel mode"):
        mlx_engine.load(str(smollm2_gguf), progress=False, parallel="data")


def test_serve_splits_its_model_and_stops_when_a_rank_dies(tmp_path, smollm2_gguf):
    """``serve --parallel``: rank 0 answers OpenAI and ollama clients as one process does (batched requests too), the
    split model stays loaded whatever keep_alive a client asks, and a dead rank fails the next request and ends the
    server."""
    import ollama
    import openai

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # pipeline: two ranks that share these 2 cores decode ~2.5x faster so than with tensor parallelism's two
    # all-reduces per layer (measured 23 vs 9.4 tok/s, gemma3); the timeout only bounds a hang (3 batched answers took
    # over 60 s on a slow machine)
    cmd = _cli("serve", "--model", str(smollm2_gguf), "--parallel", "pipeline", "--port", str(port), "--transport",
               "ring")
    procs = _launch(tmp_path, [cmd, cmd])
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=300)
        for _ in range(120):
            try:
                client.models.list()
                break
            except openai.APIConnectionError:
                time.sleep(0.5)
        questions = ["Name three colors.", "Name a fruit.", "Count to five."]

        def ask(q: str) -> str:
            r = client.chat.completions.create(model=str(smollm2_gguf), temperature=0, max_tokens=20,
                                               messages=[{"role": "user", "content": q}])
            return r.choices[0].message.content

        import concurrent.futures

        with concurrent.futures.ThreadPoolExecutor(3) as ex:
            answers = list(ex.map(ask, questions))
        import mlx_engine

        alone = mlx_engine.load(str(smollm2_gguf), progress=False, context_length=512)
        want = [alone.chat([{"role": "user", "content": q}], temperature=0, max_tokens=20) for q in questions]
        assert answers == want
        o = ollama.Client(host=f"http://127.0.0.1:{port}")
        o.generate(model=str(smollm2_gguf), prompt="Hi", options={"num_predict": 4}, keep_alive=0)
        assert [m.model for m in o.ps().models] == [str(smollm2_gguf)]  # still loaded: keep_alive 0 is ignored
        procs[1].send_signal(signal.SIGKILL)
        with pytest.raises(openai.APIError, match="another rank of the distributed run is gone"):
            ask("Hello?")
        _, err = procs[0].communicate(timeout=30)
        assert procs[0].returncode == 1 and "another rank of the distributed run is gone" in err
    finally:
        for p in procs:
            p.kill()


def _hf_folder(tmp: Path) -> Path:
    """A random Qwen3 checkpoint (tied head, query/key norms, 4 heads over 2 key/value heads, 4 layers) in Hugging
    Face's folder layout, with a small trained BPE tokenizer and a chat template."""
    from safetensors.numpy import save_file

    from tests.test_models_random import CONFIGS, FFN, HEAD_DIM, HEADS, HIDDEN, KV_HEADS, LAYERS, _random_weights
    from tests.zimage_small import small_tokenizer

    tokenizer = small_tokenizer()
    vocab = 512
    assert len(tokenizer) <= vocab
    rng = np.random.default_rng(5)
    weights = _random_weights(rng, qk_norm=True, gemma=False)
    weights["model.embed_tokens.weight"] = (rng.standard_normal((vocab, HIDDEN)) * 0.5).astype(np.float32)
    config = dict(CONFIGS["qwen3"], vocab_size=vocab, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                  num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, intermediate_size=FFN)
    folder = tmp / "qwen3-random"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    save_file(weights, str(folder / "model.safetensors"))
    tokenizer.save_pretrained(str(folder))
    return folder


@pytest.mark.parametrize("mode,size", [("pipeline", 2), ("tensor", 3)])
def test_a_safetensors_folder_splits_like_a_gguf_file(tmp_path, mode, size):
    """Hugging Face names, a tied head and query/key norms: the same tokens and logits as one process (3 ranks over
    2 key/value heads: two ranks share one)."""
    folder = _hf_folder(tmp_path)
    subprocess.run(_worker(folder, "single", tmp_path / "one.json"), check=True, timeout=300,
                   env={**os.environ, "PYTHONPATH": str(REPO)})
    results = _finish(_launch(tmp_path, [_worker(folder, mode, tmp_path / "split.json")] * size))
    assert all(code == 0 for code, _, _ in results), [e[-2000:] for _, _, e in results]
    got, want = (json.loads((tmp_path / f).read_text()) for f in ("split.json", "one.json"))
    for g, w in zip(got["prompts"], want["prompts"]):
        assert g["tokens"] == w["tokens"]
        assert np.max(np.abs(np.array(g["logits"]) - w["logits"])) <= 1e-4 * np.max(np.abs(w["logits"]))
    assert got["chat"] == want["chat"]


def test_chat_on_two_ranks_answers_as_one_process(tmp_path, smollm2_gguf):
    """``chat --parallel``: rank 0 reads the conversation from stdin (rank 1 never reads it) and answers each turn
    as one process does."""
    turns = "Hello! Who are you?\nName a color.\n/bye\n"
    args = ["chat", str(smollm2_gguf), "--temperature", "0", "--max-tokens", "16"]
    alone = subprocess.run(_cli(*args), input=turns, capture_output=True, text=True, timeout=120)
    cmd = _cli(*args, "--parallel", "pipeline", "--transport", "ring")
    procs = _launch(tmp_path, [cmd, cmd], stdin=subprocess.PIPE)
    try:
        outs = [p.communicate(text, timeout=120) for p, text in zip(procs, (turns, ""))]
        results = [(p.returncode, o, e) for p, (o, e) in zip(procs, outs)]
    finally:
        for p in procs:
            p.kill()
    assert alone.returncode == 0 and [r[0] for r in results] == [0, 0], results[0][2][-2000:]
    assert results[0][1] == alone.stdout and alone.stdout.strip()
    assert results[1][1] == ""  # rank 1 prints nothing


def test_distributed_benchmark_reports_every_figure(smollm2_gguf):
    """``benchmarks/distributed.py`` at tiny sizes: one process, then two ranks, with speed, communication and
    per-rank memory (the figures themselves come from a full run on a quiet machine, not from a test)."""
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "distributed.py"), str(smollm2_gguf), "--ranks",
                        "1", "2", "--modes", "tensor", "--prompt-tokens", "32", "--decode-tokens", "4", "--reps", "1",
                        "--json"], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads(r.stdout)
    assert [(x["mode"], x["ranks"]) for x in rows] == [("single", 1), ("tensor", 2)]
    assert all(x["decode_tok_s"] > 0 and x["prefill_tok_s"] > 0 for x in rows)
    assert rows[1]["comm_ms_per_token"] > 0 and rows[1]["messages_per_token"] == 2 + 2 * 30
    assert [x["rank"] for x in rows[1]["per_rank"]] == [0, 1]
    assert all(x["peak_bytes"] > 0 for x in rows[1]["per_rank"])


def test_a_rank_that_never_starts_stops_the_others_in_bounded_time(tmp_path, smollm2_gguf):
    """Rank 0 alone (rank 1 never started): the transport's listening side would wait for ever; the start-up
    watchdog ends it after MLX_ENGINE_RANK_TIMEOUT seconds with a message that says what to check."""
    hostfile = _hostfile(tmp_path, 2)
    t0 = time.monotonic()
    r = subprocess.run(_cli("run", str(smollm2_gguf), "Hi", "--parallel", "tensor", "--transport", "ring"),
                       env={**_env(0, hostfile), "MLX_ENGINE_RANK_TIMEOUT": "3"}, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode != 0 and time.monotonic() - t0 < 30
    assert "did not all connect and agree on the model within 3 s" in r.stderr and "Traceback" not in r.stderr


def test_a_control_message_that_never_completes_ends_rank_0_with_a_clear_message():
    """A collective to a peer the transport has given up waits for ever (holding the interpreter): rank 0's watch
    ends the process MLX_ENGINE_PEER_TIMEOUT seconds into a control message, and only then (a message that completes
    disarms it, however long the process then idles)."""
    code = """if True:
        import threading, time
        from mlx_engine.models.layers.parallel import DistributedModel
        from mlx_engine.api.parallel import _peer_watch

        class Group:  # the first message goes through, the second never completes
            rank, size, calls = 0, 2, 0

            def broadcast_bytes(self, data, capacity=4096):
                self.calls += 1
                if self.calls > 1:
                    threading.Event().wait()
                return data

        model = DistributedModel(None, None, Group(), None)
        model.watch = _peer_watch(1.5)
        model.send_control("stats")
        time.sleep(3)
        print("idle past the timeout", flush=True)
        model.send_control("forward")
        print("never here", flush=True)
    """
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == -signal.SIGKILL and time.monotonic() - t0 < 30
    assert r.stdout.splitlines() == ["idle past the timeout"]
    assert "did not take a control message within 1.5 s (MLX_ENGINE_PEER_TIMEOUT)" in r.stderr
    assert "Traceback" not in r.stderr
