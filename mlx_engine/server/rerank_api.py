"""Rerank routes: ``POST /v1/rerank`` and ``POST /rerank``, in the shape llama.cpp's server, Jina and Cohere use.

Request: ``model``, ``query`` (a string), ``documents`` (strings, or objects with a ``text`` string, as Jina and
Cohere take), ``top_n`` (the best ``n``; default all), ``return_documents`` (each result carries ``document:
{"text": ...}``; default false). Beyond them: ``normalize`` (default true: scores through a sigmoid, in 0..1, as
sentence-transformers' ``CrossEncoder``, Jina and Cohere give; false: the raw logit, as llama.cpp's server gives) and
``truncate`` (default true). Response: ``results`` best first, each ``index`` (into ``documents``) and
``relevance_score``; ``usage`` counts the tokens run. The pairs of one request run together in padded forward
passes on the device thread, between the chat models' steps (:meth:`mlx_engine.api.EmbeddingModel.rerank`).
"""

from __future__ import annotations

import time
from typing import Optional, Union

from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from mlx_engine.server import openai_api
from mlx_engine.server.http import HTTPProblem, ServerState, read_json, validate


class _Document(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    text: str


class RerankRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    model: str = Field(min_length=1)
    query: str = Field(min_length=1)
    documents: list[Union[str, _Document]]
    top_n: Optional[int] = Field(None, ge=1)
    return_documents: bool = False
    normalize: bool = True
    truncate: bool = True


def routes(state: ServerState) -> list[Route]:
    async def rerank(request: Request) -> Response:
        try:
            req = validate(RerankRequest, await read_json(request, state.max_body_bytes))
            if not req.documents:
                raise HTTPProblem(400, "documents is empty: send a non-empty list", param="documents")
            texts = [d if isinstance(d, str) else d.text for d in req.documents]
            loaded = await state.pool.embedder(req.model)
            model = loaded.obj

            def run() -> tuple[list[dict], int]:
                ids, _ = model.reranker.pair_tokens(req.query, texts, req.truncate) if model.reranker else ([], None)
                results = model.rerank(req.query, texts, top_n=req.top_n, normalize=req.normalize,
                                       truncate=req.truncate)
                return results, sum(len(x) for x in ids)

            loaded.in_flight += 1
            try:
                results, tokens = await state.worker.run(run)
            finally:
                loaded.in_flight -= 1
                loaded.last_used = time.time()
        except Exception as e:  # noqa: BLE001 -- rendered in OpenAI's error form, as llama.cpp's server does
            return openai_api.error_response(e)
        if req.return_documents:
            results = [{**r, "document": {"text": texts[r["index"]]}} for r in results]
        request.scope.setdefault("state", {})["log"] = f"{req.model} {len(texts)} documents, {tokens} tokens"
        return JSONResponse({"object": "list", "model": req.model, "results": results,
                             "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})

    return [Route("/v1/rerank", rerank, methods=["POST"]), Route("/rerank", rerank, methods=["POST"])]
