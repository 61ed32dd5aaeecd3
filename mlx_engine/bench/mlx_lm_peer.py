"""mlx-lm as a peer engine: its own ``llama`` / ``gemma3_text`` model classes on weights that the ``gguf`` package
dequantizes from the same GGUF file (float32), independent of our weight readers and models.

Used by the parity tests (reference logits and greedy tokens) and by ``mlx-engine bench --compare mlx-lm`` (the
same measurements as for this engine, run through mlx-lm's own ``generate_step``). It lives in the bench,
above the API, because it drives ``mlx`` and ``mlx_lm`` directly (the one module besides the MLX backend allowed to).
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import numpy as np

from mlx_engine.bench.float_reference import dequantized
from mlx_engine.mlx.runtime import mx  # loads OpenBLAS before mlx on Linux
from mlx_engine.models.generation.scoring import sum_nll

_NAMES = [
    (r"token_embd\.weight", "model.embed_tokens.weight"),
    (r"output_norm\.weight", "model.norm.weight"),
    (r"output\.weight", "lm_head.weight"),
    (r"blk\.(\d+)\.attn_norm\.weight", r"model.layers.\1.input_layernorm.weight"),
    (r"blk\.(\d+)\.attn_q\.weight", r"model.layers.\1.self_attn.q_proj.weight"),
    (r"blk\.(\d+)\.attn_k\.weight", r"model.layers.\1.self_attn.k_proj.weight"),
    (r"blk\.(\d+)\.attn_v\.weight", r"model.layers.\1.self_attn.v_proj.weight"),
    (r"blk\.(\d+)\.attn_output\.weight", r"model.layers.\1.self_attn.o_proj.weight"),
    (r"blk\.(\d+)\.attn_q_norm\.weight", r"model.layers.\1.self_attn.q_norm.weight"),
    (r"blk\.(\d+)\.attn_k_norm\.weight", r"model.layers.\1.self_attn.k_norm.weight"),
    (r"blk\.(\d+)\.post_attention_norm\.weight", r"model.layers.\1.post_attention_layernorm.weight"),
    (r"blk\.(\d+)\.post_ffw_norm\.weight", r"model.layers.\1.post_feedforward_layernorm.weight"),
    (r"blk\.(\d+)\.ffn_gate\.weight", r"model.layers.\1.mlp.gate_proj.weight"),
    (r"blk\.(\d+)\.ffn_up\.weight", r"model.layers.\1.mlp.up_proj.weight"),
    (r"blk\.(\d+)\.ffn_down\.weight", r"model.layers.\1.mlp.down_proj.weight"),
]


def _field(reader: Any, key: str) -> Any:
    return reader.fields[key].contents()


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's ``permute`` of Q/K rows (interleaved RoPE layout back to Hugging Face's halves)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def dequantized_tensors(path: "str | Path") -> tuple[Any, dict[str, np.ndarray]]:
    """``(reader, {gguf name: float32 array})``: every tensor of a GGUF file dequantized by the ``gguf`` package,
    NumPy order (outermost first)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    return reader, {t.name: values for t, values in dequantized(reader)}


def mlx_lm_model(path: "str | Path", folder: "str | Path | None" = None) -> Any:
    """mlx-lm's model class for a Llama or Gemma 3 GGUF file, loaded with float32 weights dequantized by ``gguf``.
    With ``folder``, also write it there as an mlx-lm model folder (``config.json``, ``model.safetensors``; the
    tokenizer is the caller's to add), which ``mlx_lm.server --model`` serves.

    Raises ``ValueError`` for another architecture.
    """
    reader, tensors = dequantized_tensors(path)
    arch = _field(reader, "general.architecture")
    g = lambda k, d=None: _field(reader, f"{arch}.{k}") if f"{arch}.{k}" in reader.fields else d  # noqa: E731
    ffn_norm = "pre_feedforward_layernorm" if arch == "gemma3" else "post_attention_layernorm"
    weights = {}
    heads, kv_heads = int(g("attention.head_count")), int(g("attention.head_count_kv"))
    for name in list(tensors):
        arr = tensors.pop(name)
        m = re.match(r"blk\.(\d+)\.ffn_norm\.weight$", name)
        hf = f"model.layers.{m.group(1)}.{ffn_norm}.weight" if m else None
        for pat, rep in _NAMES:
            if hf is None and re.match(pat + "$", name):
                hf = re.sub(pat + "$", rep, name)
        if hf is None:
            continue
        if arch == "llama" and hf.endswith("q_proj.weight"):
            arr = _unpermute(arr, heads)
        if arch == "llama" and hf.endswith("k_proj.weight"):
            arr = _unpermute(arr, kv_heads)
        if arch == "gemma3" and "norm" in hf:
            arr = arr - 1.0  # GGUF holds Gemma's 1 + w; mlx-lm adds the one itself
        weights[hf] = mx.array(arr)
        mx.eval(weights[hf])
    hidden = int(g("embedding_length"))
    common = dict(hidden_size=hidden, num_hidden_layers=int(g("block_count")),
                  intermediate_size=int(g("feed_forward_length")), num_attention_heads=heads,
                  num_key_value_heads=kv_heads, rms_norm_eps=float(g("attention.layer_norm_rms_epsilon")),
                  vocab_size=int(weights["model.embed_tokens.weight"].shape[0]))
    if arch == "llama":
        from mlx_lm.models import llama as mod

        args = mod.ModelArgs(model_type="llama", rope_theta=float(g("rope.freq_base")),
                             tie_word_embeddings="lm_head.weight" not in weights, **common)
    elif arch == "gemma3":
        from mlx_lm.models import gemma3_text as mod

        args = mod.ModelArgs(model_type="gemma3_text", head_dim=int(g("attention.key_length")),
                             rope_theta=float(g("rope.freq_base")), query_pre_attn_scalar=int(g("attention.key_length")),
                             sliding_window=int(g("attention.sliding_window")),
                             max_position_embeddings=int(g("context_length")), **common)
    else:
        raise ValueError(f"no mlx-lm peer for the {arch!r} architecture (llama and gemma3 are supported)")
    model = mod.Model(args)
    if hasattr(model, "sanitize"):
        weights = model.sanitize(weights)
    model.load_weights(list(weights.items()))
    mx.eval(model.parameters())
    if folder is not None:
        import dataclasses
        import json

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        mx.save_safetensors(str(folder / "model.safetensors"), weights)
        config = {k: v for k, v in dataclasses.asdict(args).items() if v is not None}
        config.setdefault("max_position_embeddings", int(g("context_length")))
        (folder / "config.json").write_text(json.dumps(config, indent=1))
    return model


def mlx_lm_greedy(model: Any, tokens: list[int], n: int) -> tuple[np.ndarray, list[int]]:
    """First-step logits (float32 ``[vocab]``) and ``n`` greedy tokens from an mlx-lm model."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    # the model's body over the prompt, its LM head on the last position only: the head over every position (Gemma
    # 3's 262144-word vocabulary) costs more than the prompt's layers and gives rows nobody reads
    # (each class's own test: gemma3_text keeps `tie_word_embeddings` on the model, most in `args`; lfm2 is always
    # tied and has no flag, nor an `lm_head`)
    hidden = model.model(mx.array(tokens)[None], cache)[:, -1:]
    tied = getattr(model, "tie_word_embeddings", getattr(model.args, "tie_word_embeddings", None))
    tied = "lm_head" not in model if tied is None else tied
    logits = (model.model.embed_tokens.as_linear(hidden) if tied else model.lm_head(hidden))[0, -1]
    logits = logits.astype(mx.float32)
    first = np.array(logits)
    out = []
    tok = int(mx.argmax(logits).item())
    for _ in range(n):
        out.append(tok)
        logits = model(mx.array([[tok]]), cache=cache)[0, -1]
        tok = int(mx.argmax(logits).item())
    return first, out


class MLXLMPeer:
    """mlx-lm on a GGUF file, measured the way the benchmark measures this engine.

    Attributes:
        model: the mlx-lm ``Model``. weights_bytes: bytes of its parameters on the device.
    """

    name = "mlx-lm"
    peak_counts = "MLX's peak of allocated bytes"

    def __init__(self, path: "str | Path"):
        from mlx.utils import tree_flatten

        self.model = mlx_lm_model(path)
        self.weights_bytes = sum(v.nbytes for _, v in tree_flatten(self.model.parameters()))
        mx.clear_cache()

    def run(self, tokens: list[int], max_tokens: int) -> dict[str, float]:
        """Generate ``max_tokens`` greedy tokens after ``tokens`` with a fresh prompt cache, through mlx-lm's
        ``generate_step`` (chunked prefill, pipelined decode, one host read per token).

        Returns ``ttft_s`` (seconds from the call to the first token on the host), ``decode_tps`` (tokens per
        second after the first; 0 when only one was asked), ``peak_bytes`` (the device's peak during the run, less
        what other owners held before it, plus these weights) and ``tokens`` (how many came).
        """
        from mlx_lm.models.cache import make_prompt_cache

        cache = make_prompt_cache(self.model)
        prompt = mx.array(np.asarray(tokens, np.int32))
        mx.eval(prompt)
        others = mx.get_active_memory() - self.weights_bytes
        mx.reset_peak_memory()
        timed = self._generate(prompt, max_tokens, cache)
        timed["peak_bytes"] = float(mx.get_peak_memory() - others)
        del cache
        return timed

    def _generate(self, prompt: Any, max_tokens: int, cache: list[Any]) -> dict[str, float]:
        """``max_tokens`` greedy tokens after ``prompt`` (an int32 array) through ``generate_step`` on ``cache``:
        ``ttft_s``, ``decode_tps`` (0 when only one was asked) and ``tokens``, as :meth:`run` returns them."""
        from mlx_lm.generate import generate_step

        t0 = time.perf_counter()
        first = None
        n = 0
        for _tok, _ in generate_step(prompt, self.model, max_tokens=max_tokens, prompt_cache=cache):
            n += 1
            if first is None:
                first = time.perf_counter()
        end = time.perf_counter()
        return {"ttft_s": first - t0, "decode_tps": (n - 1) / (end - first) if n > 1 and end > first else 0.0,
                "tokens": float(n)}

    def decode_at_context(self, prompt: list[int], tokens: int, reps: int) -> float:
        """Median decode tokens/s of ``tokens`` greedy tokens after ``prompt``, as
        :meth:`mlx_engine.bench.run.EngineSide.decode_at_context` measures ours: the prompt but its last token is
        prefilled once (in chunks of 512, no LM head), its cache kept aside, and every repetition (after one
        untimed) starts from a copy of it, feeds the last prompt token and decodes through ``generate_step``. A copy
        rather than a trim: the sliding-window layers' rotating caches (Gemma 3) cannot be trimmed once they
        wrapped."""
        from mlx_lm.models.cache import make_prompt_cache

        cache = make_prompt_cache(self.model)
        for begin in range(0, len(prompt) - 1, 512):
            self.model.model(mx.array(prompt[begin:min(begin + 512, len(prompt) - 1)])[None], cache)
            mx.eval([c.state for c in cache])
        kept = [c.state for c in cache]
        rates = []
        for i in range(reps + 1):
            for c, state in zip(cache, kept):  # each array copied: a cache updates its arrays in place
                c.state = tuple(mx.array(a) if isinstance(a, mx.array) else a for a in state)
            decode = self._generate(mx.array(prompt[-1:]), tokens, cache)["decode_tps"]
            if i:  # the first run warmed up
                rates.append(decode)
        del cache, kept
        mx.clear_cache()
        return float(np.median(rates))

    def perplexity(self, tokens: list[int], chunk: int = 128) -> float:
        """``exp`` of the mean negative log-likelihood of ``tokens[1:]`` from mlx-lm's logits, ``chunk`` positions
        per forward pass through one prompt cache (scored as :meth:`Runner.perplexity` scores ours)."""
        from mlx_lm.models.cache import make_prompt_cache

        cache = make_prompt_cache(self.model)
        nll = 0.0
        for begin in range(0, len(tokens) - 1, chunk):
            ids = tokens[begin:begin + chunk]
            logits = np.array(self.model(mx.array([ids]), cache=cache)[0].astype(mx.float32))
            targets = np.asarray(tokens[begin + 1:begin + 1 + len(ids)], np.int64)
            nll += sum_nll(logits[:len(targets)], targets)
        return float(np.exp(nll / (len(tokens) - 1)))
