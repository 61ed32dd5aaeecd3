"""``mlx-engine embed MODEL TEXT...``: embeddings of texts from an embedding model (BERT, nomic-bert), one JSON array a
line, or one JSON object with ``--json``."""

from __future__ import annotations

import json
import sys

import click

from mlx_engine.errors import InvalidRequestError


@click.command(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.argument("model")
@click.argument("texts", nargs=-1, metavar="TEXT...")
@click.option("--dimensions", type=click.IntRange(min=1), default=None,
              help="Keep the first N components of each vector (Matryoshka models), normalized after the cut.")
@click.option("--no-normalize", is_flag=True, help="The pooled vectors as they are, not L2-normalized.")
@click.option("--no-truncate", is_flag=True, help="Refuse a text longer than the model's context instead of cutting it.")
@click.option("--prompt-name", default=None, metavar="NAME",
              help="One of the model's prompts (from its config_sentence_transformers.json), e.g. query.")
@click.option("--json", "as_json", is_flag=True,
              help="One JSON object: model, dimensions and embeddings (a list of lists).")
def embed(model: str, texts: tuple[str, ...], dimensions: int | None, no_normalize: bool, no_truncate: bool,
          prompt_name: str | None, as_json: bool) -> None:
    """Embed each TEXT with MODEL (a sentence-transformers folder, a GGUF file or a store name); with no TEXT, each
    line of standard input is one text. Prints one JSON array of floats a line, in the order of the texts.

    \b
    Example: mlx-engine embed ./all-MiniLM-L6-v2 "a cat" "a dog"
    """
    from mlx_engine import api

    items = list(texts) or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not items:
        raise InvalidRequestError("no text to embed: give TEXT arguments or lines on standard input")
    loaded = api.load(model, progress=False)
    if not isinstance(loaded, api.EmbeddingModel):
        loaded.close()
        raise InvalidRequestError(f"{model} is a chat model, not an embedding model; give a BERT or nomic-bert "
                                  "folder or GGUF file")
    try:
        vectors = loaded.embed(items, dimensions=dimensions, normalize=not no_normalize, truncate=not no_truncate,
                               prompt_name=prompt_name)
    finally:
        loaded.close()
    rows = vectors.tolist()
    if as_json:
        click.echo(json.dumps({"model": loaded.name, "dimensions": vectors.shape[1], "embeddings": rows}))
    else:
        for row in rows:
            click.echo(json.dumps(row))
