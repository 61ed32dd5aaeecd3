"""Fuzzing: mutated, truncated and lying GGUF and safetensors files only ever raise ``WeightsError``.

Each mutation is written to a file, opened with ``open_weights`` and read completely (metadata, names, shapes, types
and every tensor). The outcome must be success (the mutation hit tensor data or a harmless byte) or ``WeightsError``;
any other exception fails the test. The loop runs in a child interpreter, so that a crash (a segfault, or SIGBUS from
reading a memory map past the end of a file) fails the test instead of killing pytest. The RNG is seeded: a failure
reproduces with ``python tests/test_weights_fuzz.py gguf|safetensors SEED COUNT FOLDER``.

Mutations: random byte changes in the header region; truncation at random offsets; lies in size, count, length,
dimension, type and offset fields (GGUF: the binary fields, located with ``gguf.GGUFReader``; safetensors: the JSON
entries and the header length); random garbage (with and without a valid magic); random byte changes anywhere;
for safetensors also corrupted shard indexes.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

MIN_MUTATIONS = 300


# ------------------------------------------------------------------------------------------------ base files


def _base_gguf(path: Path) -> None:
    import gguf
    import gguf.quants as gq
    from gguf import GGMLQuantizationType as T, GGUFValueType as V

    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint32("llama.context_length", 2048)
    w.add_float32("llama.rope.freq_base", 10000.0)
    w.add_bool("tokenizer.ggml.add_bos_token", True)
    w.add_string("tokenizer.chat_template", "{{ messages }}")
    w.add_key_value("tokenizer.ggml.tokens", ["<s>", "</s>", "Ġa", "é", "b"], V.ARRAY, sub_type=V.STRING)
    w.add_key_value("tokenizer.ggml.scores", [0.0, -1.0, -2.0, -3.0, -4.0], V.ARRAY, sub_type=V.FLOAT32)
    w.add_key_value("tokenizer.ggml.token_type", [3, 3, 1, 1, 1], V.ARRAY, sub_type=V.INT32)
    w.add_key_value("x.nested", [[1, 2], [3]], V.ARRAY, sub_type=V.ARRAY)
    w.add_key_value("x.u64", 2**40, V.UINT64)
    w.add_tensor("f32", rng.standard_normal((3, 8)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((2, 4)).astype(np.float16))
    for t in (T.Q4_0, T.Q4_1, T.Q8_0, T.Q5_0, T.BF16):
        w.add_tensor(t.name.lower(), gq.quantize(rng.standard_normal((4, 64)).astype(np.float32), t), raw_dtype=t)
    q4k = rng.integers(0, 256, (2, 144), dtype=np.uint8)
    q4k[:, 0:4] = np.frombuffer(np.array([0.01, 0.001], np.float16).tobytes(), np.uint8)
    w.add_tensor("q4_k", q4k, raw_dtype=T.Q4_K)
    w.add_tensor("i32", np.arange(6, dtype=np.int32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _gguf_fields(path: Path) -> tuple[list[tuple[int, int]], int]:
    """(offset, size) of every integer field of the header (counts, lengths, types, dims, offsets), and the data
    offset, located with gguf.GGUFReader."""
    import gguf

    r = gguf.GGUFReader(path)
    base = r.data.ctypes.data
    fields: list[tuple[int, int]] = []
    for f in list(r.fields.values()) + [t.field for t in r.tensors]:
        for part in f.parts:
            if part.dtype.kind in "ui" and part.dtype.itemsize in (4, 8) and part.size <= 8:
                start = part.ctypes.data - base
                fields += [(start + i * part.dtype.itemsize, part.dtype.itemsize) for i in range(part.size)]
    return fields, int(r.data_offset)


def _base_safetensors(path: Path) -> None:
    from safetensors.numpy import save_file

    rng = np.random.default_rng(1)
    save_file({
        "a.weight": rng.standard_normal((4, 8)).astype(np.float32),
        "b.weight": rng.standard_normal((3, 3)).astype(np.float16),
        "c": rng.integers(-9, 9, (5,)).astype(np.int64),
        "d": np.array([True, False]),
        "e": rng.integers(0, 255, (7,)).astype(np.uint8),
        "empty": np.zeros((0, 3), np.float32),
    }, str(path), metadata={"format": "pt"})
    # a BF16 tensor appended by hand (numpy has no bfloat16)
    data = path.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    end = max(v["data_offsets"][1] for k, v in header.items() if k != "__metadata__")
    header["bf"] = {"dtype": "BF16", "shape": [2, 3], "data_offsets": [end, end + 12]}
    h = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(h)) + h + data[8 + n:] + rng.integers(0, 256, 12, np.uint8).tobytes())


# -------------------------------------------------------------------------------------------------- mutations


def _lie_value(rng: np.random.Generator, old: int, size: int) -> int:
    top = (1 << (8 * size)) - 1
    choice = rng.integers(0, 8)
    if choice == 0:
        return 0
    if choice == 1:
        return top
    if choice == 2:
        return 1 << int(rng.integers(0, 8 * size))
    if choice == 3:
        return (old + int(rng.integers(-4, 5))) & top
    if choice == 4:
        return (old * int(rng.integers(2, 1000))) & top
    if choice == 5:
        return top >> 1
    return int(rng.integers(0, 1 << min(62, 8 * size)))


def _flip(rng, data: bytearray, lo: int, hi: int, n: int) -> None:
    for _ in range(n):
        if hi > lo:
            data[int(rng.integers(lo, hi))] = int(rng.integers(0, 256))


def gguf_mutations(base: bytes, fields, data_offset: int, rng: np.random.Generator, n: int):
    kinds = ["header-flip", "truncate", "field-lie", "garbage", "anywhere-flip", "data-flip"]
    weights = [0.3, 0.2, 0.25, 0.1, 0.1, 0.05]
    for i in range(n):
        kind = kinds[rng.choice(len(kinds), p=weights)]
        data = bytearray(base)
        if kind == "header-flip":
            _flip(rng, data, 0, data_offset, int(rng.integers(1, 9)))
        elif kind == "truncate":
            data = data[: int(rng.integers(0, len(data)))]
        elif kind == "field-lie":
            for _ in range(int(rng.integers(1, 3))):
                off, size = fields[int(rng.integers(0, len(fields)))]
                old = int.from_bytes(data[off:off + size], "little")
                data[off:off + size] = _lie_value(rng, old, size).to_bytes(size, "little")
        elif kind == "garbage":
            g = rng.integers(0, 256, int(rng.integers(0, 4096)), dtype=np.uint8).tobytes()
            data = bytearray((b"GGUF" + struct.pack("<I", 3) + g) if rng.random() < 0.7 else g)
        elif kind == "anywhere-flip":
            _flip(rng, data, 0, len(data), int(rng.integers(1, 33)))
        else:
            _flip(rng, data, data_offset, len(data), int(rng.integers(1, 33)))
        yield f"{i}:{kind}", bytes(data)


def safetensors_mutations(base: bytes, rng: np.random.Generator, n: int):
    n_header = struct.unpack("<Q", base[:8])[0]
    header = json.loads(base[8:8 + n_header])
    names = [k for k in header if k != "__metadata__"]
    body = base[8 + n_header:]
    dtypes = ["F32", "F16", "BF16", "I64", "U8", "BOOL", "F64", "I8", "F8_E4M3", "X9", "", "f32"]
    kinds = ["header-flip", "truncate", "json-lie", "length-lie", "garbage", "anywhere-flip", "data-flip"]
    weights = [0.25, 0.15, 0.25, 0.1, 0.1, 0.1, 0.05]
    for i in range(n):
        kind = kinds[rng.choice(len(kinds), p=weights)]
        data = bytearray(base)
        if kind == "header-flip":
            _flip(rng, data, 0, 8 + n_header, int(rng.integers(1, 9)))
        elif kind == "truncate":
            data = data[: int(rng.integers(0, len(data)))]
        elif kind == "json-lie":
            h = json.loads(json.dumps(header))
            for _ in range(int(rng.integers(1, 3))):
                e = h[names[int(rng.integers(0, len(names)))]]
                what = int(rng.integers(0, 7))
                if what == 0:
                    e["dtype"] = dtypes[int(rng.integers(0, len(dtypes)))]
                elif what == 1:
                    shape = e.get("shape")
                    shape = shape if isinstance(shape, list) and shape and all(type(d) is int for d in shape) \
                        else [1]
                    e["shape"] = [int(_lie_value(rng, abs(d), 8)) - (1 << 62) * int(rng.integers(0, 2))
                                  for d in shape]
                elif what == 2:
                    offs = e.get("data_offsets")
                    offs = offs if isinstance(offs, list) and len(offs) == 2 and all(type(o) is int for o in offs) \
                        else [0, 0]
                    j = int(rng.integers(0, 2))
                    offs[j] = int(_lie_value(rng, abs(offs[j]), 8))
                    e["data_offsets"] = offs
                elif what == 3:
                    e["data_offsets"] = [int(x) for x in rng.integers(-5, len(body) + 50, int(rng.integers(0, 4)))]
                elif what == 4:
                    e.pop(["dtype", "shape", "data_offsets"][int(rng.integers(0, 3))], None)
                elif what == 5:
                    e["shape"] = [1.5] if rng.random() < 0.5 else "x"
                else:
                    h["__metadata__"] = {"k": 1} if rng.random() < 0.5 else ["x"]
            hb = json.dumps(h).encode()
            data = bytearray(struct.pack("<Q", len(hb)) + hb + body)
        elif kind == "length-lie":
            data[0:8] = _lie_value(rng, n_header, 8).to_bytes(8, "little")
        elif kind == "garbage":
            g = rng.integers(0, 256, int(rng.integers(0, 4096)), dtype=np.uint8).tobytes()
            if rng.random() < 0.6:
                g = struct.pack("<Q", len(g)) + g
            data = bytearray(g)
        elif kind == "anywhere-flip":
            _flip(rng, data, 0, len(data), int(rng.integers(1, 33)))
        else:
            _flip(rng, data, 8 + n_header, len(data), int(rng.integers(1, 33)))
        yield f"{i}:{kind}", bytes(data)


def _read_all(path: Path) -> None:
    from mlx_engine.weights import open_weights

    with open_weights(path) as wf:
        for k, v in wf.metadata.items():
            repr(v)
        for name in wf.names():
            wf.shape(name)
            wf.type_name(name)
            wf.load(name)


def _attempt(path: Path, label: str, counts: dict, failures: list) -> None:
    from mlx_engine.errors import WeightsError

    try:
        _read_all(path)
        counts["ok"] += 1
    except WeightsError as e:
        counts["weights_error"] += 1
        if str(path) not in str(e):
            failures.append(f"{label}: WeightsError without the file name: {e}")
    except BaseException as e:  # noqa: BLE001 - any other exception is the failure we look for
        failures.append(f"{label}: {type(e).__name__}: {e}"[:500])


def run_fuzz(kind: str, seed: int, n: int, folder: Path) -> dict:
    """Run ``n`` mutations of the base file of ``kind`` in this process; return counts and failures."""
    import warnings

    warnings.simplefilter("error")  # a warning escaping the reader would be a bug too
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    counts = {"ok": 0, "weights_error": 0}
    failures: list[str] = []
    if kind == "gguf":
        base_path = folder / "base.gguf"
        _base_gguf(base_path)
        fields, data_offset = _gguf_fields(base_path)
        _read_all(base_path)
        base = base_path.read_bytes()
        target = folder / "m.gguf"
        for label, data in gguf_mutations(base, fields, data_offset, rng, n):
            target.write_bytes(data)
            _attempt(target, label, counts, failures)
    else:
        base_path = folder / "base.safetensors"
        _base_safetensors(base_path)
        _read_all(base_path)
        base = base_path.read_bytes()
        target = folder / "m.safetensors"
        for label, data in safetensors_mutations(base, rng, n):
            target.write_bytes(data)
            _attempt(target, label, counts, failures)
        # sharded folders whose index is corrupted
        shard_dir = folder / "sharded"
        shard_dir.mkdir(exist_ok=True)
        (shard_dir / "model-00001-of-00001.safetensors").write_bytes(base)
        names = list(json.loads(base[8:8 + struct.unpack("<Q", base[:8])[0]]))
        index = json.dumps({"metadata": {"total_size": 1},
                            "weight_map": {k: "model-00001-of-00001.safetensors" for k in names
                                           if k != "__metadata__"}}).encode()
        for i in range(max(40, n // 10)):
            data = bytearray(index)
            _flip(rng, data, 0, len(data), int(rng.integers(1, 4)))
            (shard_dir / "model.safetensors.index.json").write_bytes(bytes(data))
            _attempt(shard_dir, f"index-{i}", counts, failures)
    counts["total"] = counts["ok"] + counts["weights_error"] + len(failures)
    return {"counts": counts, "failures": failures}


# ------------------------------------------------------------------------------------------------------ tests


def _run_child(kind: str, seed: int, n: int, folder: Path) -> dict:
    repo = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(repo) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), kind, str(seed), str(n), str(folder)],
                          capture_output=True, text=True, timeout=300, env=env, cwd=str(repo))
    assert proc.returncode == 0, (f"the fuzz child for {kind} died (exit code {proc.returncode}; a negative code is "
                                  f"a signal such as SIGSEGV or SIGBUS):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("kind", ["gguf", "safetensors"])
def test_fuzzed_files_only_raise_weights_error(tmp_path: Path, kind: str):
    n = 1000
    result = _run_child(kind, seed=20240607, n=n, folder=tmp_path / kind)
    counts, failures = result["counts"], result["failures"]
    assert not failures, f"{len(failures)} mutations raised something other than WeightsError:\n" + "\n".join(
        failures[:20])
    assert counts["total"] >= MIN_MUTATIONS
    # the mutations must actually bite: most fail, some (data-only flips) still load
    assert counts["weights_error"] >= n // 3, counts
    assert counts["ok"] >= 5, counts


if __name__ == "__main__":
    kind_, seed_, n_, folder_ = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
    print(json.dumps(run_fuzz(kind_, seed_, n_, folder_)))
