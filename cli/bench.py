"""``mlx-engine bench``: speed, memory and perplexity of a model, optionally side by side with llama.cpp and mlx-lm on
the same file."""

from __future__ import annotations

import click

from mlx_engine.cli.options import ACTIVATIONS_OPTION
from mlx_engine.store import DEFAULT_MODEL


@click.command(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.argument("model", default=DEFAULT_MODEL, required=False)
@click.option("--compare", type=click.Choice(["llama.cpp", "mlx-lm"]), multiple=True,
              help="Also run this peer on the same file, alternating runs, and print ours/peer per figure (repeat "
                   "for both): llama.cpp on the GGUF as shipped (pip install 'mlx-engine[bench]'), mlx-lm on the same "
                   "weights dequantized to float32.")
@click.option("--reps", type=click.IntRange(min=1), default=3, show_default=True,
              help="Timed repetitions of each figure after one warm-up run; medians are reported.")
@click.option("--quick", is_flag=True, help="A smoke run with tiny sizes (seconds; the figures mean little).")
@click.option("--kv-bits", type=click.Choice(["none", "16", "8", "4"]), default="none", show_default=True,
              help="Our KV cache, as `run --kv-bits` (16: float16 keys and values, as llama.cpp's cache).")
@ACTIVATIONS_OPTION
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the table.")
def bench(model: str, compare: tuple[str, ...], reps: int, quick: bool, kv_bits: str, activations: str | None,
          as_json: bool) -> None:
    """Benchmark MODEL: prompt tokens/s at 512 and 2048 tokens, decode tokens/s over 128 tokens, time to first
    token, peak memory, the weights held over the file's tensor bytes, perplexity of a fixed text, the share of the
    read-bandwidth limit that the file's bytes set for decode, decode at 128 vs 4096 tokens of context, chat turn 1
    vs turn 10 time to first token, and the gain from OpenBLAS.

    With --json the object's "ratios" maps each peer to decode, prefill_512, prefill_2048, ttft, peak_memory and
    perplexity, ours divided by the peer's: above 1 is better for the rates, below 1 for the others.
    Progress goes to stderr. A full run takes minutes: use a quiet machine, or more --reps.

    \b
    Examples:
      mlx-engine bench smollm2:135m --compare llama.cpp --compare mlx-lm
      mlx-engine bench gemma3:270m --compare llama.cpp --reps 5 --json > gemma.json
      mlx-engine bench --quick
    """
    from mlx_engine.bench import format_table, run_bench

    def progress(msg: str) -> None:
        click.echo(f"bench: {msg}", err=True)

    result = run_bench(model, reps=1 if quick and reps == 3 else reps, compare=compare, quick=quick,
                       kv_bits=None if kv_bits == "none" else int(kv_bits), activations=activations, progress=progress)
    click.echo(result.to_json() if as_json else format_table(result))
