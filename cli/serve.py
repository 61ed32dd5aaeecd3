"""``mlx-engine serve``: the OpenAI- and ollama-compatible HTTP server."""

from __future__ import annotations

import logging
import os
import sys

import click

from mlx_engine.cli.options import ACTIVATIONS_OPTION
from mlx_engine.errors import EngineError, InvalidRequestError


def _size(value: str | None) -> int | None:
    from mlx_engine.server.pool import parse_bytes

    return None if value is None else parse_bytes(value)


def _option_size(value: str, option: str) -> int:
    try:
        return _size(value)
    except InvalidRequestError as e:
        raise click.BadParameter(str(e), param_hint=option) from None


@click.command()
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to bind. Anything but loopback needs --api-key.")
@click.option("--port", default=11435, show_default=True, type=int, help="TCP port (ollama uses 11434).")
@click.option("--model", "models", multiple=True, metavar="MODEL",
              help="Load this model at start (repeatable; text or image). Others load on first request.")
@click.option("--max-sequences", default=4, show_default=True, type=int,
              help="Requests decoded together per text model; more wait in a queue.")
@click.option("--context-length", default=4096, show_default=True, type=int,
              help="Tokens per sequence (prompt + answer). The KV cache for max-sequences of them is reserved at "
                   "load.")
@click.option("--keep-alive", default="5m", show_default=True,
              help="Unload a model after it has been idle this long (ollama's semantics: 0 unloads at once, a "
                   "negative value never).")
@click.option("--memory-budget", default=None, metavar="SIZE",
              help="Memory all loaded models may use together, e.g. 12GiB (default: 3/4 of the machine's memory).")
@click.option("--api-key", default=None, envvar="MLX_ENGINE_API_KEY", show_envvar=True,
              help="Require 'Authorization: Bearer KEY' on every request.")
@click.option("--kv-bits", type=click.Choice(["none", "16", "8", "4"]), default="none", show_default=True,
              help="Keep the KV cache in the compute dtype (none), as 16-bit floats (llama.cpp's and ollama's "
                   "default; on the CPU half the memory of float32), or as 8- or 4-bit affine groups.")
@click.option("--max-queue", default=64, show_default=True, type=int,
              help="Requests that may wait for a sequence; beyond that HTTP 429.")
@click.option("--prefill-chunk", default=512, show_default=True, type=int,
              help="Most prompt tokens per forward pass: running answers stall by at most one chunk.")
@click.option("--parallel", type=click.Choice(["pipeline", "tensor"]), default=None,
              help="Split the --model over the ranks mlx.launch started (rank 0 serves HTTP).")
@click.option("--transport", type=click.Choice(["any", "ring", "jaccl", "mpi", "nccl"]), default="any",
              show_default=True, help="With --parallel: mx.distributed's backend between the ranks.")
@click.option("--allowed-hosts", "allowed_hosts", multiple=True, envvar="MLX_ENGINE_ALLOWED_HOSTS", show_envvar=True,
              metavar="HOSTS", help="Host names to answer besides localhost and the bound address (comma-separated, "
                                    "repeatable; *.example.com for subdomains, * for any): a guard against DNS "
                                    "rebinding.")
@click.option("--allowed-origins", "allowed_origins", multiple=True, envvar="MLX_ENGINE_ORIGINS", show_envvar=True,
              metavar="ORIGINS", help="Web page origins that may call the server, besides local pages and desktop "
                                      "apps (comma-separated, repeatable; * is a wildcard, as OLLAMA_ORIGINS).")
@click.option("--models-dir", "models_dirs", multiple=True, metavar="DIR",
              type=click.Path(exists=True, file_okay=False), help="A folder whose model files requests may name "
              "by path (repeatable). Without it requests name only pulled and catalog models.")
@click.option("--no-pull", is_flag=True, envvar="MLX_ENGINE_NO_PULL", show_envvar=True,
              help="Refuse /api/pull: clients use only the models already here.")
@click.option("--read-timeout", default=30.0, show_default=True, type=float, metavar="SECONDS",
              help="Close a connection whose request headers take longer than this to arrive, or whose body pauses "
                   "longer than this (slow or stalled clients).")
@click.option("--speculative", type=click.Choice(["off", "lookup", "draft", "mtp"]), default=None,
              help="Speculative decoding for requests that do not set it: lookup drafts tokens from the prompt and "
                   "output, draft by the model's --draft-model, mtp by the model's own multi-token-prediction layer, "
                   "and each step checks every sequence's draft in one pass (same output).  [default: draft for a "
                   "model with a draft model, else off]")
@click.option("--draft-model", "draft_models", multiple=True, metavar="[TARGET=]DRAFT",
              help="A smaller model of the same vocabulary that drafts for TARGET (without TARGET=: for every "
                   "--model), loaded beside it with the same context length and sequences (repeatable).")
@click.option("--prompt-cache-dir", default=None, metavar="DIR",
              help="Save the KV cache of finished conversations in this folder (written in the background) and "
                   "find them again by their tokens, after a restart too: a next turn prefills only its new tokens.")
@click.option("--prompt-cache-size", default="20GB", show_default=True, metavar="SIZE",
              help="The most the --prompt-cache-dir files may take together; least recently used go first.")
@ACTIVATIONS_OPTION
def serve(host: str, port: int, models: tuple[str, ...], max_sequences: int, context_length: int, keep_alive: str,
          memory_budget: str | None, api_key: str | None, kv_bits: str | None, max_queue: int,
          prefill_chunk: int, parallel: str | None, transport: str, activations: str | None,
          allowed_hosts: tuple[str, ...], allowed_origins: tuple[str, ...], models_dirs: tuple[str, ...],
          no_pull: bool, read_timeout: float, speculative: str | None, draft_models: tuple[str, ...],
          prompt_cache_dir: str | None, prompt_cache_size: str) -> None:
    """Serve text and image models over HTTP: the OpenAI API (/v1/...) and the ollama API (/api/...).

    \b
    Example: mlx-engine serve --model smollm2:135m
             curl http://127.0.0.1:11435/v1/chat/completions -H 'Content-Type: application/json' \\
                  -d '{"model": "smollm2:135m", "messages": [{"role": "user", "content": "Hi"}]}'
    """
    from mlx_engine.server import ServerConfig
    from mlx_engine.server import serve as run_server
    from mlx_engine.server.pool import parse_keep_alive

    try:
        keep = parse_keep_alive(keep_alive, "--keep-alive")
    except InvalidRequestError as e:
        raise click.BadParameter(str(e), param_hint="--keep-alive") from None
    config = ServerConfig(host=host, port=port, models=list(models), max_sequences=max_sequences,
                          context_length=context_length, keep_alive=keep, memory_budget=_size(memory_budget),
                          api_key=api_key, kv_bits=None if kv_bits == "none" else int(kv_bits), max_queue=max_queue,
                          prefill_chunk=prefill_chunk, parallel=parallel, transport=transport,
                          activations=activations, allowed_hosts=list(allowed_hosts),
                          allowed_origins=list(allowed_origins), models_dirs=list(models_dirs), pull=not no_pull,
                          read_timeout=read_timeout, speculative=speculative, draft_models=list(draft_models),
                          prompt_cache_dir=prompt_cache_dir,
                          prompt_cache_size=_option_size(prompt_cache_size, "--prompt-cache-size"))
    config.check()
    if parallel is not None:
        from mlx_engine import api

        if api.launched_rank() != 0:  # serve rank 0's model (this returns only by ending the process)
            api.load(models[0], parallel=parallel, transport=transport, progress=False, activations=activations)
    click.echo(f"mlx-engine starting on http://{host}:{port} (OpenAI: /v1, ollama: /api); Ctrl-C stops", err=True)
    status = 0
    try:
        run_server(config)
    except EngineError as e:  # the server could not start (address in use, a --model that cannot load)
        click.echo(f"Error: {e}", err=True)
        status = 1
    # The server has stopped and its device thread has ended. MLX's threads and static destructors can race at
    # interpreter exit (std::terminate, SIGABRT after a clean stop): end the process here, output flushed.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
