"""The bench's result as a plain-text table (``mlx-engine bench`` without ``--json``): one row per compared figure,
ours beside each peer with the ratio ours / peer, then the figures of this engine alone."""

from __future__ import annotations

from collections.abc import Callable

from mlx_engine.bench.float_reference import describe
from mlx_engine.bench.run import BenchResult


def format_table(r: BenchResult) -> str:
    """The result as a plain-text table (medians; each ratio column is ours / that peer)."""
    o = r.ours
    s = r.sizes
    mib = 2**20
    rows: list[tuple[str, ...]] = []
    head: tuple[str, ...] = ("figure", "mlx-engine")
    for name in r.peers:
        head += (name, f"ratio vs {name}")
    rows.append(head)

    def row(label: str, key: str, fmt: Callable[[float], str], better: str, ratio: bool = True) -> None:
        cells = (f"{label} ({better})", fmt(o[key]))
        for name, p in r.peers.items():
            cells += (fmt(p[key]), f"{o[key] / p[key]:.2f}x" if ratio else "")
        rows.append(cells)

    row(f"prompt tok/s, {s['prefill_short']} tokens", "prefill_512", lambda v: f"{v:.1f}", "higher is better")
    row(f"prompt tok/s, {s['prefill_long']} tokens", "prefill_2048", lambda v: f"{v:.1f}", "higher is better")
    row(f"decode tok/s, {s['decode_tokens']} tokens", "decode", lambda v: f"{v:.2f}", "higher is better")
    row(f"decode tok/s after {s['context_short']} tokens of context", "decode_ctx_short", lambda v: f"{v:.2f}",
        "higher is better")
    row(f"decode tok/s after {s['context_long']} tokens of context", "decode_ctx_long", lambda v: f"{v:.2f}",
        "higher is better")
    row(f"time to first token, {s['decode_prompt']}-token prompt, ms", "ttft", lambda v: f"{v * 1000:.0f}",
        "lower is better")
    row("peak memory, MiB", "peak_memory", lambda v: f"{v / mib:.0f}", "lower is better")
    row("weights held / the file's tensor bytes", "weights_over_file", lambda v: f"{v:.2f}x", "lower is better",
        ratio=False)
    row(f"perplexity, {s['perplexity_tokens']} tokens of fixed text", "perplexity", lambda v: f"{v:.4f}",
        "lower is better")
    row("decode share of the file-bytes read limit", "file_limit_share", lambda v: f"{v * 100:.0f}%",
        "higher is better", ratio=False)
    row("decode share of copy bandwidth (bytes held)", "bandwidth_share", lambda v: f"{v * 100:.0f}%",
        "higher is better", ratio=False)
    widths = [max(len(x[c]) for x in rows) for c in range(len(head))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(x, widths)))
             for x in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    bw = r.bandwidth
    ob = r.openblas
    lines += [
        "",
        f"the file's weight tensors: {bw['file_weight_bytes'] / mib:.0f} MiB; bytes this engine reads per decode "
        f"token: {o['bytes_per_token'] / mib:.0f} MiB; read bandwidth {bw['read_bytes_per_s'] / 1e9:.1f} GB/s, copy "
        f"bandwidth {bw['copy_bytes_per_s'] / 1e9:.1f} GB/s (medians of those measured in each repetition)",
        f"decode at {s['context_long']} over {s['context_short']} tokens of context: "
        + ", ".join(f"{name} {f['long_context_ratio']:.2f}x" for name, f in [("mlx-engine", o), *r.peers.items()]),
        f"decode tok/s under a JSON schema: {o['structured_decode']:.2f} ({o['structured_ratio']:.2f}x free decode "
        "after the same prompt)",
        f"chat time to first token, turn 1 / turn {s['chat_turns']}: {o['chat_ttft_turn1'] * 1000:.0f} ms / "
        f"{o['chat_ttft_turn10'] * 1000:.0f} ms (ratio {o['chat_turn_ratio']:.2f}x)",
        f"OpenBLAS gain, {ob['matmul_n']}x{ob['matmul_n']} float32 matmul: {ob['gain']:.1f}x "
        f"({ob['reference_seconds'] * 1000:.1f} ms with {ob['reference_blas']}, {ob['default_seconds'] * 1000:.1f} ms "
        f"with {ob['default_blas']})",
        *([describe(r.peers["llama.cpp"].get("perplexity_f32"), r.float_reference, o["perplexity"])]
          if "llama.cpp" in r.peers and r.float_reference else []),
        "peak memory counts: " + "; ".join(f"{name}: {what}" for name, what in r.peak_counts.items()),
        f"{r.model} on {r.device}, {r.dtype}, KV cache {r.kv_cache}; {r.machine['cpus']} CPUs, {r.machine['platform']}; medians of "
        f"{r.reps} repetition(s) after a warm-up, engines alternating; {r.seconds:.0f} s in all",
    ]
    return "\n".join(lines)
