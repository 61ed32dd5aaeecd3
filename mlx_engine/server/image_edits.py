"""OpenAI's ``POST /v1/images/edits``: a prompt and one or more images (``image``, or ``image[]`` for several) in a
``multipart/form-data`` body, as OpenAI's API reference and its Python client (``client.images.edit``) send them.

The form's fields are those of ``/v1/images/generations`` (``prompt``, ``model``, ``n``, ``size``,
``response_format``, and this server's ``seed``, ``steps``, ``guidance``, ``negative_prompt``), given as text parts;
the images go to the model as its edit images (a model that does not edit images, or one given more than it takes,
answers 400). ``mask`` (inpainting) is refused with a 400. The answer is the generations route's, made by the same
code. The body is parsed with the standard library's MIME parser (no form-parsing dependency), under the server's
body size limit.
"""

from __future__ import annotations

import asyncio
import time
from email import policy
from email.parser import BytesParser
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from mlx_engine.server.http import HTTPProblem, ServerState, note, read_body, until_done_or_disconnect, validate
from mlx_engine.server.openai_api import ImageJob, ImageRequest, error_response, generate_images, image_size

__all__ = ["routes", "parse_form"]

_INT_FIELDS = ("n", "seed", "steps")
_FLOAT_FIELDS = ("guidance",)


def parse_form(content_type: str, body: bytes) -> tuple[dict[str, str], list[tuple[str, bytes]]]:
    """The text fields and the files (``(field name, bytes)``, in order) of a ``multipart/form-data`` body.

    Raises:
        HTTPProblem: 400 when the body is not multipart/form-data or a part has no name.
    """
    media = content_type.split(";")[0].strip().lower()
    if media != "multipart/form-data":
        raise HTTPProblem(400, f"/v1/images/edits takes a multipart/form-data body (OpenAI's form), not {media!r}")
    head = f"Content-Type: {content_type}\r\nMIME-Version: 1.0\r\n\r\n".encode("latin-1")
    msg = BytesParser(policy=policy.HTTP).parsebytes(head + body)
    if not msg.is_multipart():
        raise HTTPProblem(400, "the multipart body could not be read (no parts under its boundary)")
    fields: dict[str, str] = {}
    files: list[tuple[str, bytes]] = []
    for part in msg.iter_parts():
        name = part.get_param("name", header="content-disposition")
        if not name:
            raise HTTPProblem(400, "a part of the form has no name")
        data = part.get_payload(decode=True) or b""
        if part.get_filename() is not None or name in ("image", "image[]", "mask"):
            files.append((name, data))
        else:
            try:
                fields[name] = data.decode("utf-8")
            except UnicodeDecodeError:
                raise HTTPProblem(400, f"form field {name!r} is not UTF-8 text", param=name) from None
    return fields, files


def _typed(fields: dict[str, str]) -> dict[str, Any]:
    """The form's text values as the JSON route's types (a 400 naming a field that is not a number)."""
    out: dict[str, Any] = dict(fields)
    for k in _INT_FIELDS + _FLOAT_FIELDS:
        if k in out:
            try:
                out[k] = int(out[k]) if k in _INT_FIELDS else float(out[k])
            except ValueError:
                raise HTTPProblem(400, f"{k} must be a number, got {out[k]!r}", param=k) from None
    return out


def routes(state: ServerState) -> list[Route]:
    async def edits(request: Request) -> Response:
        try:
            body = await read_body(request, state.max_body_bytes)
            fields, files = parse_form(request.headers.get("content-type", ""), body)
            if any(name == "mask" for name, _ in files):
                raise HTTPProblem(400, "mask (inpainting) is not supported; send the images to edit and a prompt",
                                  param="mask")
            images = [data for name, data in files if name in ("image", "image[]")]
            if not images:
                raise HTTPProblem(400, "no image to edit: send it as the form's 'image' file (or 'image[]' for "
                                       "several)", param="image")
            req = validate(ImageRequest, _typed(fields))
            width, height = image_size(req)
            loaded = await state.pool.image(req.model)
        except Exception as e:  # noqa: BLE001
            return error_response(e)
        job = ImageJob()
        try:
            data = await until_done_or_disconnect(
                request, generate_images(state, loaded, req, width, height, job, edit_images=images))
        except asyncio.CancelledError:
            job.cancelled = True
            return Response(status_code=499)
        except Exception as e:  # noqa: BLE001
            return error_response(e)
        note(request, loaded.name)
        return JSONResponse({"created": int(time.time()), "data": data})

    return [Route("/v1/images/edits", edits, methods=["POST"])]
