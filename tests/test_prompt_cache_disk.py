"""The prompt cache on disk (``serve --prompt-cache-dir``): a conversation saved by one server is continued by the next
one from its file (only the new tokens prefilled, the same greedy answer as a cold server); files of other weights,
another cache type, corrupted or truncated ones are deleted and never loaded; the folder stays under its size. And
the snapshots under it: a sliding-window model (random Gemma 3, window 8) and a hybrid one (random LFM2, convolution
states and checkpoints) continue from a snapshot that went through a file exactly as the sequence it was taken from.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import time
from pathlib import Path

import numpy as np
import openai
import pytest
from safetensors.numpy import load_file

from mlx_engine.server import ServerConfig
from mlx_engine.server.prompt_cache import FORMAT, VERSION, read_arrays, read_header, write_file
from mlx_engine.kvcache.snapshot import Snapshot, describe, export_sequence, import_sequence
from tests.conftest import link_model

NAME = "smollm2:135m"
#: a conversation of about 1,500 tokens (the issue's restart test): notes in the system message, then a question
NOTES = " ".join(f"Note {i}: the shelf by the window holds box number {i}." for i in range(110))
TURN1 = [{"role": "system", "content": "You keep these notes. " + NOTES},
         {"role": "user", "content": "Name three colors."}]


@contextlib.contextmanager
def serving(home: Path, **config):
    """A server of smollm2 on ``home``'s store; yields ``(server, client)``; stopping it writes what is queued."""
    from tests.test_server import RunningServer, free_port

    srv = RunningServer(ServerConfig(port=free_port(), models=[NAME], max_sequences=2, context_length=2048,
                                     store_root=str(home), **config))
    try:
        yield srv, openai.OpenAI(base_url=srv.url + "/v1", api_key="unused")
    finally:
        srv.stop()


def ask(client, messages, max_tokens: int = 12):
    r = client.chat.completions.create(model=NAME, messages=messages, max_tokens=max_tokens, temperature=0)
    return r.choices[0].message.content, r.usage


def written(disk, n: int) -> None:
    """Wait until ``disk`` has written ``n`` files (the device thread queues a snapshot after the answer's end)."""
    for _ in range(600):
        if disk.stats()["writes"] >= n and disk.flush():
            return
        time.sleep(0.05)
    raise AssertionError(f"{n} files were not written: {disk.stats()}")


def files(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in folder.iterdir()}


def test_a_restarted_server_continues_from_disk_and_refuses_bad_files(home_with_smollm2: Path, smollm2_gguf: Path,
                                                                      tmp_path: Path):
    home, saved, other = home_with_smollm2, tmp_path / "cache", tmp_path / "bad"
    with serving(home) as (_, client):  # the oracle: a cold server, no cache on disk
        answer1, _ = ask(client, TURN1)
        turn2 = TURN1 + [{"role": "assistant", "content": answer1}, {"role": "user", "content": "And two more?"}]
        want2, _ = ask(client, turn2)

    with serving(home, prompt_cache_dir=str(saved)) as (_, client):
        got1, usage1 = ask(client, TURN1)
    assert got1 == answer1 and usage1.prompt_tokens >= 1500, usage1
    (name1, size1), = files(saved).items()
    data = load_file(str(saved / name1))  # safetensors' own reader takes the file
    keys = data["keys"].tolist()
    assert len(keys) > usage1.prompt_tokens  # the prompt and the answer (but its last token, never fed)
    _, meta, _ = read_header(saved / name1)
    assert json.loads(meta["model"])["name"] == NAME and json.loads(meta["cache"])["kind"] == "causal"

    # bad copies for a server of their own: the same file with one byte of its data flipped, and one cut short
    other.mkdir()
    raw = bytearray((saved / name1).read_bytes())
    raw[-100] ^= 0xFF
    (other / name1).write_bytes(bytes(raw))
    cut = name1[:17] + "f" * 32 + ".safetensors"
    (other / cut).write_bytes((saved / name1).read_bytes()[:size1 // 2])

    with serving(home, prompt_cache_dir=str(saved)) as (srv, client):  # restarted on the same folder
        got2, usage2 = ask(client, turn2)
        hits = srv.status()["prompt_cache"]["hits"]
    assert got2 == want2
    assert usage2.prompt_tokens_details.cached_tokens == len(keys)  # only the new tokens were prefilled
    assert hits == 1
    assert name1 not in files(saved) and len(files(saved)) == 1  # the longer conversation superseded it

    with serving(home, prompt_cache_dir=str(other)) as (srv, client):
        assert cut not in files(other)  # truncated: deleted when the folder was read
        got2, usage2 = ask(client, turn2)
    assert got2 == want2 and usage2.prompt_tokens_details.cached_tokens == 0
    assert name1 not in files(other)  # corrupted: deleted when its bytes failed their sha256

    # another cache type (8-bit), in a folder of 1 MiB: the float file goes at load; then each conversation's file
    # pushes the one before out
    limit = 1 << 20
    with serving(home, prompt_cache_dir=str(saved), kv_bits=8, prompt_cache_size=limit) as (srv, client):
        assert files(saved) == {}
        disk = srv.state.pool.prompt_cache
        seen = []
        for i, q in enumerate(["Name three colors.", "Count to five.", "Say hello in French."]):
            _, usage = ask(client, [{"role": "user", "content": q}], max_tokens=8)
            if i == 0:  # (the next ones share the chat template's system prompt in memory)
                assert usage.prompt_tokens_details.cached_tokens == 0
            written(disk, i + 1)
            now = files(saved)
            seen.append(set(now))
            assert 0 < sum(now.values()) <= limit
            assert max(now.values()) * 2 > limit  # two files never fit: eviction had to run
        assert seen[0].isdisjoint(seen[2]) and seen[1] != seen[2]
        assert disk.stats()["deleted"] >= 2

    # the same name served from other weights (a copy of the file: another path and time): its files are deleted
    home2 = tmp_path / "home2"
    folder = link_model(smollm2_gguf.parent, home2)
    for f in folder.iterdir():
        if f.is_symlink():
            f.unlink()
            shutil.copy(f.resolve() if f.exists() else smollm2_gguf.parent / f.name, f)
    kept = files(saved)
    with serving(home2, prompt_cache_dir=str(saved), kv_bits=8) as (_, client):
        assert not set(kept) & set(files(saved))
        _, usage = ask(client, [{"role": "user", "content": "Count to five."}], max_tokens=8)
    assert usage.prompt_tokens_details.cached_tokens == 0


# ---- snapshots of sliding-window and recurrent caches, through a file -------------------------------------------
def _through_a_file(snap: Snapshot, path: Path) -> Snapshot:
    write_file(path, snap.arrays, {"format": FORMAT, "version": VERSION})
    header, meta, start = read_header(path)
    return Snapshot(snap.length, read_arrays(path, header, meta, start), snap.resume_from, snap.resume_points)


def _gemma3(tmp_path: Path):
    from mlx_engine.mlx import MLXBackend
    from mlx_engine.models.registry import load_text_model
    from mlx_engine.models.generation.runner import Runner
    from tests.conftest import NoText
    from tests.test_models_random import _make_folder

    folder, _, _ = _make_folder(tmp_path, "gemma3")
    # the window layers keep the window and 256 positions more (DecoderModel.make_cache): the prompt goes past both
    return 300, lambda: Runner(load_text_model(MLXBackend(folder, dtype="float32")), NoText(), context_length=512,
                               max_sequences=3, prefill_chunk=64)


def _lfm2(tmp_path: Path):
    from tests.hybrid_small import build_lfm2
    from tests.test_hybrid_models import _runner

    folder = tmp_path / "lfm2"
    build_lfm2(folder)
    return 60, lambda: _runner(folder, chunk=16, sequences=3, interval=24)  # past two checkpoints


@pytest.mark.parametrize("build", [_gemma3, _lfm2], ids=["gemma3-window-8", "lfm2-hybrid"])
def test_a_snapshot_continues_exactly_as_its_sequence(build, tmp_path):
    from mlx_engine.models.generation.runner import Request
    from mlx_engine.models.generation.sampler import SamplerOptions

    n, make = build(tmp_path)
    a, b, cold = make(), make(), make()
    prompt = [int(t) for t in np.random.default_rng(5).integers(3, 250, n)]
    first = list(a.generate_tokens(Request(prompt, SamplerOptions(temperature=0.0), max_tokens=6, sequence=0)))
    held = a.cached_tokens(0)
    assert held == (prompt + first)[:len(held)] and len(held) == len(prompt) + len(first) - 1

    snap = export_sequence(a.cache, 0)
    assert snap.resume_from > 1 or snap.resume_points  # it cannot resume everywhere: the case under test
    assert describe(a.cache) == describe(b.cache) is not None
    for p in range(snap.length + 1):  # where it can resume, as the cache it came from says
        assert snap.restore_point(p) == a.cache.restore_point(0, p), p
    snap = _through_a_file(snap, tmp_path / "snap.safetensors")
    with b.backend.new_context() as ctx:
        import_sequence(ctx, b.cache, 2, snap)
    b.adopt(2, held)
    for p in range(snap.length + 1):
        assert b.cache.restore_point(2, p) == a.cache.restore_point(0, p), p
    again = export_sequence(b.cache, 2)  # what b holds now is what a held, bit for bit (in cells of its own)
    assert again.arrays.keys() == snap.arrays.keys()
    assert all(np.array_equal(again.arrays[k], snap.arrays[k]) for k in snap.arrays)

    turn2 = held + [int(t) for t in np.random.default_rng(6).integers(3, 250, 20)]
    logits, ran = {}, {}
    for name, runner, seq in (("a", a, 0), ("b", b, 2), ("cold", cold, 1)):
        with runner.backend.new_context() as ctx:
            out, ran[name] = runner.prefill(ctx, seq, turn2)
            logits[name] = out.numpy()
    assert ran == {"a": 20, "b": 20, "cold": len(turn2)}  # from the snapshot only the new tokens ran
    # the same keys and values in other cells (a window's ring wraps elsewhere), and a model that prefilled it all
    # in other chunks: float32 sums in another order, measured 2e-7 of the largest logit
    for other in ("a", "cold"):
        assert np.abs(logits["b"] - logits[other]).max() <= 1e-5 * np.abs(logits[other]).max(), other
    tokens = [list(r.generate_tokens(Request(turn2, SamplerOptions(temperature=0.0), max_tokens=8, sequence=s)))
              for r, s in ((b, 2), (cold, 1))]
    assert tokens[0] == tokens[1]
