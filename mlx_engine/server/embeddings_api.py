"""Embedding routes: OpenAI's ``POST /v1/embeddings`` and ollama's ``POST /api/embed`` and older ``/api/embeddings``.

Each request's inputs run together in padded forward passes on the device thread, between the text models' steps
(:class:`mlx_engine.models.embedding.embedder.Embedder`). Semantics, with the differences stated:

- ``/v1/embeddings`` (OpenAI's API reference): ``input`` a string, a list of strings, a list of token ids or a list of
  such lists (token ids run as given, no special tokens added); ``dimensions`` keeps the first components and
  renormalizes (Matryoshka); ``encoding_format`` ``float`` or ``base64`` (little-endian float32 bytes, what the
  ``openai`` client asks for by default). Beyond OpenAI: ``truncate`` (default true), as ollama's, and each item's
  ``truncated`` (true where the input was longer than the model's context and was cut).
- ``/api/embed`` (ollama's ``api/types.go`` ``EmbedRequest``): ``input`` a string or a list of strings, ``truncate``
  (default true: an input longer than the context is cut; false: a 400), ``dimensions``, ``keep_alive``; vectors
  L2-normalized. Beyond ollama: ``truncated``, one boolean per input (true where it was cut).
- ``/api/embeddings`` (ollama's older ``EmbeddingRequest``): one ``prompt``, one vector, not normalized (as ollama's
  answer from its llama.cpp runner).

A chat model named here is refused with a 400 (it gives no embeddings here); an embedding model named at a chat route
is refused there in the same way.
"""

from __future__ import annotations

import base64
import time
from typing import Any, Literal, Optional, Union

import numpy as np
from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from mlx_engine.server import ollama_api, openai_api
from mlx_engine.server.http import HTTPProblem, ServerState, read_json, validate
from mlx_engine.server.pool import Loaded, parse_keep_alive


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class OpenAIEmbeddingRequest(_Strict):
    model: str = Field(min_length=1)
    input: Union[str, list[str], list[int], list[list[int]]]
    dimensions: Optional[int] = Field(None, ge=1)
    encoding_format: Literal["float", "base64"] = "float"
    truncate: bool = True
    user: Optional[str] = None


class OllamaEmbedRequest(_Strict):
    model: str = Field(min_length=1)
    input: Union[str, list[str]]
    truncate: bool = True
    dimensions: Optional[int] = Field(None, ge=1)
    keep_alive: Union[str, int, float, None] = None
    options: Optional[dict[str, Any]] = None


class OllamaEmbeddingsRequest(_Strict):
    model: str = Field(min_length=1)
    prompt: str = Field(min_length=1)
    keep_alive: Union[str, int, float, None] = None
    options: Optional[dict[str, Any]] = None


async def _embed(state: ServerState, loaded: Loaded, texts: "list[str] | None", ids: "list[list[int]] | None",
                 dimensions: int | None, normalize: bool, truncate: bool) -> tuple[np.ndarray, int, list[bool]]:
    """``(vectors float32 [n, d], tokens run, truncated)`` of a request's inputs, on the device thread;
    ``truncated[i]``: input ``i`` was longer than the model's context and was cut (issue 64 item 4)."""
    model = loaded.obj
    if not (texts or ids):
        raise HTTPProblem(400, "input is empty: send a string or a non-empty list", param="input")

    def run() -> tuple[np.ndarray, int, list[bool]]:
        inputs = model.tokenize(texts, truncate=truncate, fit=False) if texts is not None else ids
        vectors = model.embed_tokens(inputs, dimensions=dimensions, normalize=normalize, truncate=truncate)
        return (vectors, sum(min(len(x), model.context_length) for x in inputs),
                [len(x) > model.context_length for x in inputs])

    loaded.in_flight += 1
    try:
        return await state.worker.run(run)
    finally:
        loaded.in_flight -= 1
        loaded.last_used = time.time()


def routes(state: ServerState) -> list[Route]:
    pool = state.pool

    async def openai_embeddings(request: Request) -> Response:
        try:
            req = validate(OpenAIEmbeddingRequest, await read_json(request, state.max_body_bytes))
            loaded = await pool.embedder(req.model)
            raw = [req.input] if isinstance(req.input, str) or (req.input and isinstance(req.input[0], int)) \
                else req.input
            texts = raw if raw and isinstance(raw[0], str) else None
            ids = None if texts is not None else raw
            vectors, tokens, cut = await _embed(state, loaded, texts, ids, req.dimensions, True, req.truncate)
        except Exception as e:  # noqa: BLE001 -- rendered in OpenAI's error form
            return openai_api.error_response(e)
        request.scope.setdefault("state", {})["log"] = f"{req.model} {len(vectors)} inputs, {tokens} tokens"

        def encoded(v: np.ndarray) -> Any:
            if req.encoding_format == "base64":
                return base64.b64encode(v.astype("<f4").tobytes()).decode("ascii")
            return v.tolist()

        return JSONResponse({"object": "list", "model": req.model,
                             "data": [{"object": "embedding", "index": i, "embedding": encoded(v),
                                       "truncated": cut[i]} for i, v in enumerate(vectors)],
                             "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})

    async def _ollama(request: Request, schema: type, legacy: bool) -> Response:
        t0 = time.perf_counter()
        try:
            req = validate(schema, await read_json(request, state.max_body_bytes))
            keep = parse_keep_alive(req.keep_alive) if req.keep_alive is not None else None
            loaded = await pool.embedder(req.model, keep)
            t1 = time.perf_counter()
            if legacy:
                texts, dims, normalize, truncate = [req.prompt], None, False, True
            else:
                texts = [req.input] if isinstance(req.input, str) else req.input
                dims, normalize, truncate = req.dimensions, True, req.truncate
            vectors, tokens, cut = await _embed(state, loaded, texts, None, dims, normalize, truncate)
        except Exception as e:  # noqa: BLE001 -- rendered in ollama's error form
            return ollama_api.error_response(e)
        if legacy:
            return JSONResponse({"embedding": vectors[0].tolist()})
        load_ns = int((t1 - t0) * 1e9) if loaded.loaded_at >= time.time() - (time.perf_counter() - t0) else 0
        return JSONResponse({"model": req.model, "embeddings": vectors.tolist(),
                             "total_duration": int((time.perf_counter() - t0) * 1e9), "load_duration": load_ns,
                             "prompt_eval_count": tokens, "truncated": cut})

    async def ollama_embed(request: Request) -> Response:
        return await _ollama(request, OllamaEmbedRequest, legacy=False)

    async def ollama_embeddings(request: Request) -> Response:
        return await _ollama(request, OllamaEmbeddingsRequest, legacy=True)

    return [Route("/v1/embeddings", openai_embeddings, methods=["POST"]),
            Route("/api/embed", ollama_embed, methods=["POST"]),
            Route("/api/embeddings", ollama_embeddings, methods=["POST"])]
