"""The public Python API: load a model, generate, stream, chat.

>>> import mlx_engine
>>> model = mlx_engine.load("smollm2:135m")            # pulls it on first use
>>> model.generate("What is the capital of France?", max_tokens=32)
>>> for piece in model.stream("Tell me a story", temperature=0.7, seed=1):
...     print(piece if isinstance(piece, str) else piece.summary(), end="")
>>> chat = model.chat_session(system="You are terse.")
>>> "".join(p for p in chat.send("Hi!") if isinstance(p, str))

Options accepted by ``generate``, ``stream``, ``chat`` and ``ChatSession.send`` (keywords):
``system`` (str), ``raw`` (bool: no chat template), ``temperature`` (0 = greedy, the default), ``top_k``, ``top_p``,
``min_p``, ``repeat_penalty``, ``repeat_last_n``, ``presence_penalty``, ``frequency_penalty``, ``seed``,
``max_tokens`` (default 256), ``stop`` (list of strings), structured output: ``format`` / ``response_format``
(``"json"``, a JSON schema, OpenAI's form), ``json_schema``, ``regex``, ``grammar``, and ``think`` (True, False,
``"low"``, ``"medium"``, ``"high"``: whether a reasoning model thinks; it reaches the chat template as
``enable_thinking`` / ``reasoning_effort``). An unknown or invalid option raises
:class:`mlx_engine.errors.InvalidRequestError`.

A reasoning model's thinking is kept apart from its answer: ``stream`` yields it as
:class:`~mlx_engine.models.text.reasoning.Thinking` chunks (a ``str`` subclass) before the answer's plain ``str`` chunks;
``generate`` and ``chat`` return an :class:`Answer` (the answer's text, with ``.thinking``); ``respond``'s
:class:`ChatReply` has ``thinking``. Stop strings and structured output apply to the answer only.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mlx_engine.api.embed import EmbeddingModel, is_embedding_checkpoint  # noqa: F401 -- the pool's, too
from mlx_engine.errors import (ChatTemplateError, GenerationInterruptedError,
                               InvalidRequestError, MemoryBudgetError)
from mlx_engine.kvcache.storage import HALF_KV_BITS, KV_BITS, kv_value_bytes, stored_dtype
from mlx_engine.api.image import (generate_image, load_image_model, open_init_image, read_image_parameters,
                                  save_image)
from mlx_engine.ml import DType
from mlx_engine.mlx import MLXBackend
from mlx_engine.models.layers.config import ATTENTION_TYPES
from mlx_engine.models.generation.answer import Answer, ChatReply, ToolPrompt, collect_answer, whole_answer
from mlx_engine.models.vision.images import IMAGE_SUFFIXES, load_image
from mlx_engine.models.generation.options import OPTION_NAMES, GenerationOptions
from mlx_engine.models.layers.plan import DecodePlan
from mlx_engine.models.text.reasoning import Thinking, parse_think, think_template_vars
from mlx_engine.models.registry import half_dtype, load_text_checkpoint
from mlx_engine.models.generation.runner import GenerationStats, Runner
from mlx_engine.models.text.tools import (ToolCall, check_tools, prepare_messages,
                                     tool_choice_format, tool_style)
from mlx_engine.models.vision.vision import chat_prompt
from mlx_engine.api.memory import limit_buffer_cache, memory_in_use, memory_stats, release_memory
from mlx_engine.api.parallel import launched_rank, load_sharded
from mlx_engine.api.session import ChatSession
from mlx_engine.store import DEFAULT_IMAGE_MODEL, DEFAULT_MODEL, Store
from mlx_engine.store.format import printable

__all__ = ["load", "generate", "stream", "chat", "Model", "EmbeddingModel", "ChatSession", "ChatReply", "Answer", "Thinking", "ToolCall",
           "GenerationStats", "GenerationOptions",
           "OPTION_NAMES", "DEFAULT_MODEL", "generate_image", "load_image_model", "DEFAULT_IMAGE_MODEL",
           "open_init_image", "read_image_parameters", "save_image", "memory_in_use", "memory_stats",
           "limit_buffer_cache", "release_memory", "launched_rank", "load_image",
           "IMAGE_SUFFIXES"]

DEFAULT_CONTEXT = 8192  # cap on the cache's capacity unless the caller asks for more
_CLOSE_WAIT_S = 10.0  # how long close() waits for a generation in another thread to stop


def _parsed(options: GenerationOptions | None, given: dict[str, Any]) -> GenerationOptions:
    """``options`` parsed already, else ``given`` parsed now (:meth:`GenerationOptions.parse`).

    Raises:
        InvalidRequestError: both, or an invalid option by name.
    """
    if options is None:
        return GenerationOptions.parse(given)
    if given:
        raise InvalidRequestError(f"options come parsed (options=) or by name, not both (also {', '.join(given)})")
    return options


class Model:
    """A loaded text model: weights on the device, tokenizer, and a runner with its KV cache.

    Safe to use from several threads: requests are serialized by a lock around the runner (a stream holds it from
    its first item until it ends or is closed, so a stream left unread blocks the others; close it). For requests
    batched together, use the server (``mlx-engine serve``).

    Args (beyond :func:`load`'s): max_sequences: sequences the KV cache holds at once; prefill_chunk: the most
    tokens of one forward pass; reserve: allocate the KV cache's worst case at load (a model that cannot fit fails
    here, not mid-request).

    Attributes:
        name: the name it was loaded by. architecture: the checkpoint's, as GGUF's ``general.architecture`` or the
        Hugging Face ``model_type`` spells it (``llama``, ``gemma3``, ``qwen3``, ``lfm2``, ``qwen3_next``, ``mllama``,
        ...; ``mlx_engine.models.registry.ARCHITECTURES`` lists them).
        info: architecture, parameters, quantization, context_length, chat_template, license, source, path.
        context_length: the most tokens a sequence may hold here.
        activations: what the CPU's quantized products do with x, ``float32``, ``int8`` or ``int16`` (see
            :func:`load`).
        load_seconds, weights_bytes, load_peak_bytes: what loading took (seconds, bytes on the device, and the
            device's peak memory during the load above what other models held before it).
    """

    def __init__(self, name: str, path: Path, *, source: str = "file", license: str | None = None,
                 device: str | None = None, dtype: str | None = None, context_length: int | None = None,
                 kv_bits: int | None = None, requantize: int | None = None, max_sequences: int = 4,
                 prefill_chunk: int = 2048, reserve: bool = False, parallel: str | None = None,
                 transport: str = "any", mmproj: "str | Path | None" = None, activations: str | None = None):
        t0 = time.perf_counter()
        _check_load_arguments(device=device, dtype=dtype, context_length=context_length, kv_bits=kv_bits,
                              max_sequences=max_sequences, prefill_chunk=prefill_chunk)

        half = half_dtype(path)
        if dtype is not None and DType.parse(dtype) == DType.FLOAT16 and half != DType.FLOAT16:
            raise InvalidRequestError(f"{path.name} cannot compute in float16: its architecture's activations outgrow "
                                      f"float16's range (the output would be NaN); use dtype {half.value} or float32")

        def make_backend(p: Path, shard: Any = None) -> MLXBackend:
            return MLXBackend(p, device=device, dtype=dtype, requantize=requantize, shard=shard, half_dtype=half,
                              activations=activations)

        self.distributed = None
        if parallel is not None:
            text, self.distributed = load_sharded(path, make_backend, parallel, transport,
                                                  {"dtype": dtype, "requantize": requantize,
                                                   "activations": activations})
        else:
            text = load_text_checkpoint(path, make_backend, mmproj=Path(mmproj).expanduser() if mmproj else None)
        self.backend, self.tokenizer = text.backend, text.tokenizer
        self.text_model = self.distributed or text.model
        self.load_peak_bytes = self.backend.peak_memory() - getattr(self.backend, "memory_before_load", 0)
        self.weights_bytes = self.backend.weights_nbytes()
        config = self.text_model.config
        ctx_len = context_length or min(config.context_length, DEFAULT_CONTEXT)
        if ctx_len < 2:
            raise InvalidRequestError(f"context_length must be at least 2, got {ctx_len}")
        self.kv_cache_bytes = self._check_kv_memory(ctx_len, max_sequences, prefill_chunk, kv_bits)
        self.text_model.use_context(ctx_len)
        self.context_length = ctx_len
        self.kv_bits = kv_bits
        self.activations = self.backend.activations
        self.runner = Runner(self.text_model, self.tokenizer, context_length=ctx_len, max_sequences=max_sequences,
                             prefill_chunk=prefill_chunk, kv_bits=kv_bits, reserve=reserve)
        self.load_seconds = time.perf_counter() - t0
        self.name = self.runner.name = name
        self.path = path
        self.architecture = config.architecture
        types = getattr(self.backend, "tensor_types", {})
        quant = max(set(types.values()), key=list(types.values()).count) if types else "unknown"
        self.info = {
            "architecture": self.architecture, "parameters": self._parameter_count(), "quantization": quant,
            "context_length": config.context_length, "chat_template": self.tokenizer.chat_template,
            "license": printable(license), "source": source, "path": str(path),
        }
        self._free_sequences = list(range(1, max_sequences))
        self._lock = threading.RLock()  # one request at a time on the runner (see _serialized)
        self._closed = self._released = False  # close() was called; the weights were let go
        self.draft: Model | None = None  # the draft model of speculative decoding (load's draft_model)

    @property
    def kv_cache_type(self) -> str:
        """What the KV cache keeps keys and values as: a dtype (``float16``, ...) or ``8-bit`` / ``4-bit``."""
        kv = self.kv_bits
        return f"{kv}-bit" if kv in KV_BITS else stored_dtype(kv, self.text_model.dtype).value

    @property
    def decode_plan(self) -> "DecodePlan":
        """How a one-token decode step runs each layer of the model (this rank's, distributed), and why a layer does
        not take the fused forms (:mod:`mlx_engine.models.layers.plan`); ``describe()`` prints it."""
        return self.text_model.plan

    def _check_kv_memory(self, ctx_len: int, max_sequences: int, prefill_chunk: int, kv_bits: int | None) -> int:
        """The KV cache's worst case in bytes (every sequence full), refused when it does not fit the device beside
        the weights.

        Raises:
            MemoryBudgetError: the message gives both numbers and what to lower.
        """
        c = self.text_model.config
        per_value = kv_value_bytes(kv_bits, self.text_model.dtype.itemsize)
        numbers = 0  # per sequence, every layer's cells times the numbers a cell holds
        for i, kind in enumerate(c.layer_types):
            if kind not in ATTENTION_TYPES:
                continue  # a recurrent layer's state is counted below
            window = c.sliding_window if kind == "sliding_attention" else None
            cells = ctx_len if window is None else min(ctx_len, window + 256 + prefill_chunk)
            numbers += cells * self.text_model.kv_width(i)
        need = int(max_sequences * (numbers * per_value + self.text_model.state_bytes()))
        have = self.backend.device_memory()
        free = have - self.weights_bytes
        if need > free:
            raise MemoryBudgetError(
                f"a context of {ctx_len:,} tokens for {max_sequences} sequences needs {_gib(need)} of KV cache, but "
                f"the device has {_gib(have)} ({_gib(max(0, free))} beside the weights); lower context_length "
                f"(--context-length)" + ("" if kv_bits in KV_BITS else " or use kv_bits=4 (--kv-bits 4)"))
        return need

    def _parameter_count(self) -> int:
        """Elements of every tensor of the file (a rank of a distributed run holds only its share of them)."""
        shapes = getattr(self.backend, "tensor_shapes", None) or [t.shape for t in self.backend.weights.values()]
        return sum(math.prod(s) for s in shapes)

    @property
    def reads_images(self) -> bool:
        """True for a model with a vision part (images in prompts)."""
        return self.text_model.vision is not None

    @property
    def has_chat_template(self) -> bool:
        """True for an instruction-tuned model that ships a chat template."""
        return self.tokenizer.has_chat_template

    @property
    def backend_name(self) -> str:
        return self.backend.name

    @property
    def thinks(self) -> bool:
        """True for a reasoning model: its chat template (or vocabulary) has a thinking span."""
        return self.runner.think_markers is not None

    def template_vars(self, think: Any) -> dict[str, Any]:
        """The chat-template variables of the ``think`` option (``enable_thinking``...; see
        :func:`mlx_engine.models.text.reasoning.think_template_vars`).

        Raises:
            InvalidRequestError: ``think`` not one of None, True, False, ``low``, ``medium``, ``high``; or asked of
                a model that does not think (as ollama refuses it).
        """
        think = parse_think(think)
        if think and not self.thinks:
            raise InvalidRequestError(f"{self.name} does not think (its chat template has no thinking span); "
                                      "leave think unset or false")
        return think_template_vars(think)

    # ---- prompts -----------------------------------------------------------------------------------------------
    def _encode_text(self, text: str) -> list[int]:
        bos = self.tokenizer.bos_token
        add_bos = None if not bos or not text.startswith(bos) else False  # the template already wrote BOS
        return self.tokenizer.encode(text, add_bos=add_bos)

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The chat template applied to ``messages`` (``{"role", "content"}`` dicts)."""
        self._check_messages(messages)
        try:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        except ChatTemplateError as e:
            raise ChatTemplateError(f"{self.name}'s chat template: {e}") from e

    def _chat_ids(self, messages: list[dict[str, Any]], **template_vars: Any) -> list[int]:
        """Token ids of ``messages`` rendered by the chat template (``template_vars`` such as ``tools`` reach it);
        special tokens typed in a message stay text (see :meth:`mlx_engine.models.text.tokenizer.Tokenizer.encode_chat`)."""
        self._check_messages(messages)
        try:
            return self.tokenizer.encode_chat(messages, **template_vars)
        except ChatTemplateError as e:
            raise ChatTemplateError(f"{self.name}'s chat template: {e}") from e

    @staticmethod
    def _check_messages(messages: Any) -> None:
        if not isinstance(messages, (list, tuple)):
            raise InvalidRequestError(f"messages must be a list of {{'role', 'content'}} dicts, not "
                                      f"{type(messages).__name__}")
        for m in messages:
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise InvalidRequestError(f"each message must be a dict with 'role' and 'content', got {m!r:.200}")
            if not isinstance(m["role"], str) or not isinstance(m["content"], (str, list, type(None))):
                raise InvalidRequestError(f"a message's role must be a string and its content a string (or a list "
                                          f"of parts), got {m!r:.200}")

    def prompt_tokens(self, prompt: str, *, system: str | None = None, raw: bool | None = None) -> list[int]:
        """Token ids for a one-shot prompt: the chat template for instruct models, raw text for base models (or
        when ``raw``)."""
        return self.prompt_inputs(prompt, system=system, raw=raw)[0]

    def prompt_inputs(self, prompt: str, images: Any = None, *, system: str | None = None,
                      raw: bool | None = None, **template_vars: Any) -> tuple[list[int], list]:
        """:meth:`prompt_tokens` and the ``images`` at their places (``PromptImage``): in the user message with the
        chat template (``template_vars`` reach it), else (raw) each image's marker before the text.

        Raises:
            InvalidRequestError: an empty prompt, images that are not a list, images for a model that reads none.
        """
        if not isinstance(prompt, str):
            raise InvalidRequestError(f"the prompt must be a string, not {type(prompt).__name__}")
        if not prompt.strip():
            raise InvalidRequestError("the prompt is empty; give some text")
        if images is not None and not isinstance(images, (list, tuple)):
            raise InvalidRequestError("images must be a list (of paths, bytes, base64 strings or PIL images)")
        if raw is None:
            raw = not self.has_chat_template
        vision = self.text_model.vision
        if raw and images and vision is not None:
            ids = self._encode_text(vision.expand(vision.boi_text * len(images) + prompt))
            return ids, vision.place(ids, images)
        if raw and not images:
            return self._encode_text((system + "\n\n" if system else "") + prompt), []
        messages = ([{"role": "system", "content": system}] if system else []) + \
            [{"role": "user", "content": prompt, **({"images": list(images)} if images else {})}]
        return self.chat_inputs(messages, **template_vars)

    def chat_inputs(self, messages: list[dict[str, Any]], **template_vars: Any) -> tuple[list[int], list]:
        """Token ids of a conversation (the chat template applied, the assistant's turn opened) and the images of
        its messages at their places (``PromptImage``; ``models.vision.chat_prompt``).

        Raises:
            InvalidRequestError: an empty conversation, a malformed message, images for a model that reads none.
        """
        self._check_messages(messages)
        if not messages:
            raise InvalidRequestError("the conversation is empty; give at least one user message")
        try:
            return chat_prompt(self.tokenizer, self.text_model.vision, list(messages), **template_vars)
        except ChatTemplateError as e:
            raise ChatTemplateError(f"{self.name}'s chat template: {e}") from e

    def chat_tokens(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of a conversation with the chat template applied and the assistant's turn opened.

        Raises:
            InvalidRequestError: an empty conversation or a malformed message.
        """
        return self.chat_inputs(messages)[0]

    def text_tokens(self, text: str) -> list[int]:
        """Token ids of raw text (no chat template; BOS added as the model wants)."""
        return self._encode_text(text)

    def perplexity(self, text: str) -> float:
        """Perplexity of raw ``text`` (``exp`` of the mean negative log-likelihood per token of every token after
        the first, natural log), in one window of at most ``context_length`` tokens; uses sequence 0.

        Raises:
            InvalidRequestError: fewer than 2 tokens, or more than the context holds.
        """
        tokens = self.text_tokens(text)
        with self._lock, self.text_model.backend.new_context() as ctx:
            nll, _ = self.runner.perplexity(ctx, tokens)
        return math.exp(nll)

    # ---- generation --------------------------------------------------------------------------------------------
    def stream(self, prompt: str, *, images: Any = None, options: GenerationOptions | None = None,
               **given: Any) -> Iterator["str | GenerationStats"]:
        """Text chunks as they are generated, then one :class:`GenerationStats`. ``images``: images the prompt
        is about (paths, bytes, base64 strings, PIL images), for a model with a vision part. The options come by
        name (``given``, parsed here) or parsed already (``options``, :meth:`GenerationOptions.parse`); raises
        ``InvalidRequestError`` for both at once."""
        opts = _parsed(options, given)
        tokens, placed = self.prompt_inputs(prompt, images, system=opts.system, raw=opts.raw,
                                            **self.template_vars(opts.think))
        return self._serialized(self.runner.stream(opts.request(tokens, images=placed)))

    def _serialized(self, pieces: Iterator[Any]) -> Iterator[Any]:
        """``pieces`` (a runner's stream) run under the model's lock: one request at a time uses the runner and its
        KV cache, whichever thread asks; the lock is taken at the first item and let go when the stream ends or is
        closed. MLX gives each thread its own default stream, so the work runs on the calling thread's."""
        with self._lock:
            text: list[str] = []
            try:
                if self._closed:
                    raise InvalidRequestError(f"the model {self.name} is closed; load it again")
                while True:
                    if self._closed:  # close() from another thread (or from this loop's body): stop before the
                        # next token touches the weights; the caller gets an error, never a short answer
                        raise GenerationInterruptedError(
                            f"the answer is incomplete: the model {self.name} was closed while it was being "
                            "generated; load it again and retry", "closed", "".join(text))
                    try:
                        p = next(pieces)
                    except StopIteration:
                        return
                    if isinstance(p, str):
                        text.append(p)
                    yield p
            except RuntimeError as e:
                if self.distributed is None:
                    raise
                raise self.distributed.lost(e) from None
            finally:
                pieces.close()
                self._release_if_closed()

    def generate(self, prompt: str, *, images: Any = None, **options: Any) -> "Answer":
        """The whole completion of ``prompt``: an :class:`Answer` (the answer's text; a reasoning model's thinking
        in its ``thinking``).

        With a response format (``response_format=``, ``format=``, ``json_schema=``, ``regex=``, ``grammar=``) the
        text matches it; raises ``IncompleteOutputError`` (its ``text`` holds the partial output) when
        ``max_tokens`` or the context cut it off first."""
        return whole_answer(self.stream(prompt, images=images, **options))

    def chat(self, messages: list[dict[str, str]], **options: Any) -> "Answer":
        """The assistant's answer to a conversation (``[{"role": "user", "content": ...}, ...]``) as an
        :class:`Answer` (with ``thinking``); structured output as in :meth:`generate`."""
        opts = GenerationOptions.parse(options)
        tokens, placed = self.chat_inputs(messages, **self.template_vars(opts.think))
        return whole_answer(self._serialized(self.runner.stream(opts.request(tokens, images=placed))))

    def tool_prompt(self, messages: list[dict[str, Any]], tools: list | None = None,
                    tool_choice: Any = None, **template_vars: Any) -> "ToolPrompt":
        """The prompt of a conversation with tools (see :mod:`mlx_engine.models.text.tools`): the tools offered through
        the chat template (or, for a template without tools, in the system message), earlier calls and ``tool``
        results written back, and for ``tool_choice`` ``required`` or a named function the grammar that forces one
        valid call. ``tool_choice`` ``none`` offers no tools (earlier calls and results stay in the conversation).
        ``template_vars`` (``enable_thinking``...) reach the template.

        Raises:
            InvalidRequestError: malformed tools, tool calls or tool messages; a ``tool_choice`` without tools or
                naming a function that is not among them.
        """
        style = tool_style(self.tokenizer.chat_template)
        offered = check_tools(tools) if tools else None
        if tool_choice not in (None, "auto", "none") and not offered:
            raise InvalidRequestError(f"tool_choice {tool_choice!r:.80} needs tools")
        active = offered if tool_choice != "none" else None
        fmt = tool_choice_format(active, tool_choice, style) if active else None
        prepared = prepare_messages(messages, active, style)
        tokens = self._chat_ids(prepared, **template_vars, **({"tools": active} if active and style.native else {}))
        return ToolPrompt(tokens, fmt, style, {t["function"]["name"] for t in active} if active else None)

    def respond(self, messages: list[dict[str, Any]], *, tools: list | None = None, tool_choice: Any = None,
                **options: Any) -> "ChatReply":
        """The assistant's answer to a conversation, with tool calls: its text and the calls parsed from it.

        ``tools``: OpenAI's / ollama's function list; ``tool_choice``: ``auto`` (default: the model decides),
        ``none``, ``required`` or ``{"type": "function", "function": {"name": ...}}`` (the last two force one call
        whose arguments validate against the function's parameters). Assistant messages may carry ``tool_calls``
        and ``tool`` messages the results. Other options as :meth:`chat`; the calls are parsed from the answer only,
        never from the thinking.
        """
        opts = GenerationOptions.parse(options)
        prompt = self.tool_prompt(messages, tools, tool_choice, **self.template_vars(opts.think))
        if prompt.response_format is not None:
            opts = GenerationOptions.parse({**options, "response_format": prompt.response_format})
        text, thinking, stats = collect_answer(self._serialized(self.runner.stream(opts.request(prompt.tokens))))
        content, calls = prompt.parse(text)
        finish = "tool_calls" if calls else ("length" if stats.stop_reason == "length" else "stop")
        return ChatReply(content, calls, finish, stats, thinking)

    def check_format(self, options: GenerationOptions) -> None:
        """Compile ``options.response_format`` (if any) for this model's vocabulary, so that a format the model
        cannot follow fails before generation starts. Raises ``InvalidRequestError``."""
        if options.response_format is not None:
            self.runner.constraint(options.request([0]))

    def embed(self, texts: Any, **options: Any) -> Any:
        """Refused (``InvalidRequestError``): a chat model gives no embeddings here; load an embedding model."""
        raise InvalidRequestError(f"{self.name} is a {self.architecture} chat model, not an embedding model; load an "
                                  "embedding model (a BERT or nomic-bert folder or GGUF) to embed text")

    def chat_session(self, system: str | None = None, **options: Any) -> "ChatSession":
        """A conversation that keeps its KV cache between turns."""
        GenerationOptions.parse(options)
        seq = self._free_sequences.pop(0) if self._free_sequences else 0
        return ChatSession(self, seq, system, options)

    def attach_draft(self, draft: Any) -> None:
        """Speculate with ``draft`` (a :class:`Model` of the same vocabulary, with at least this model's sequences
        and context length), then owned by this model. Raises ``InvalidRequestError`` (and closes ``draft``) for
        an embedding model, another vocabulary or fewer sequences."""
        try:
            if not isinstance(draft, Model):
                raise InvalidRequestError(f"the draft model {draft.name} is an embedding model, not a text model")
            self.runner.attach_draft(draft.runner, self.name, draft.name)
        except BaseException:
            draft.close()
            raise
        self.draft = draft

    def close(self) -> None:
        """Let go of the weights and the KV cache. A generation running in another thread stops before its next
        token and raises :class:`~mlx_engine.errors.GenerationInterruptedError`; later calls raise
        ``InvalidRequestError``. Waits up to 10 seconds for a running generation to stop; a stream left unread past
        that lets go of the model itself when it is next read or closed."""
        self._closed = True
        if self._lock.acquire(timeout=_CLOSE_WAIT_S):
            try:
                self._release_if_closed()
            finally:
                self._lock.release()

    def _release_if_closed(self) -> None:
        """With the lock held: free the model once, after close()."""
        if not self._closed or self._released:
            return
        self._released = True
        if self.distributed is not None:
            self.distributed.stop()
        if self.text_model.vision is not None:
            self.text_model.vision.close()
        if self.draft is not None:
            self.draft.close()
        self.backend.close()


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def _check_load_arguments(*, device: Any, dtype: Any, context_length: Any, kv_bits: Any, max_sequences: Any,
                          prefill_chunk: Any) -> None:
    """Types and ranges of :func:`load`'s arguments, checked before anything is read or allocated.

    Raises:
        InvalidRequestError: the argument, its value and what it must be.
    """
    for name, value in (("device", device), ("dtype", dtype)):
        if value is not None and not isinstance(value, str):
            raise InvalidRequestError(f"{name} must be a string or None, not {value!r}")
    if dtype is not None:
        try:
            floating = DType.parse(dtype).is_floating
        except ValueError:
            floating = False
        if not floating:
            raise InvalidRequestError(f"unknown dtype {dtype!r}; use float32, float16 or bfloat16 (or f32, f16, bf16)")
    for name, value, low in (("context_length", context_length, 2), ("max_sequences", max_sequences, 1),
                             ("prefill_chunk", prefill_chunk, 1)):
        if value is None and name == "context_length":
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value < 2**31:
            raise InvalidRequestError(f"{name} must be an integer from {low} to 2**31 - 1, not {value!r}")
    if kv_bits is not None and (isinstance(kv_bits, bool) or kv_bits not in KV_BITS + (HALF_KV_BITS,)):
        raise InvalidRequestError(f"kv_bits must be one of {', '.join(map(str, KV_BITS + (HALF_KV_BITS,)))} or None, "
                                  f"not {kv_bits!r}")


def load(model: str = DEFAULT_MODEL, *, device: str | None = None, dtype: str | None = None,
         context_length: int | None = None, pull: bool = True, progress: bool = True, kv_bits: int | None = None,
         requantize: int | None = None, parallel: str | None = None, transport: str = "any",
         mmproj: "str | Path | None" = None, activations: str | None = None,
         draft_model: "str | None" = None) -> Model:
    """Load a model by catalog name (``smollm2:135m``, ``gemma3:270m``), GGUF path, Hugging Face folder,
    ``hf:org/repo`` or ollama name; pulls catalog models on first use. An encoder (BERT, nomic-bert) loads as an
    :class:`~mlx_engine.api.embed.EmbeddingModel` (``.embed(texts)``; ``device`` and ``dtype`` only).

    ``parallel="pipeline"`` or ``"tensor"`` splits the model over the ranks that ``mlx.launch`` started
    (``transport``: ``mx.distributed``'s backend, ``any``, ``ring``, ``jaccl``, ``mpi`` or ``nccl``): each rank
    reads only its share of the file. On rank 0 the model works as any other; on every other rank this call serves
    rank 0 and then ends the process (``SystemExit(0)`` when rank 0 closes its model or exits). ``mmproj``: the
    vision file llama.cpp ships beside a Gemma 3 GGUF, so that the model reads images. ``dtype``: the compute
    dtype; default float32 on the CPU, and on a GPU float16, or bfloat16 for Gemma 3 (whose activations outgrow
    float16). ``kv_bits``: None (the default): the KV cache's keys and values in the compute dtype; 16: as 16-bit
    floats (llama.cpp's and ollama's default f16 cache: float16, or bfloat16 under a bfloat16 compute dtype, so that
    only a float32 compute dtype, the CPU's, is narrowed: half its memory, a decode step reads half the bytes); 8 or
    4: as affine groups (of 64). Not 16 by default: its rounding turns the last bits in which a batched step differs
    from a lone one into visible differences, and a greedy answer should not depend on what else the server runs.
    ``activations``: what the CPU's quantized products do with x: ``"float32"`` (the default, or
    ``$MLX_ENGINE_ACTIVATIONS``): the exact product with the dequantized weights, the float model's tokens; ``"int8"``:
    x quantized as llama.cpp does for the weight's type (per 32 elements, its Q8_0; per 256 for K-quants, its Q8_K)
    and integer dot products (AVX-512 VNNI or AVX2), llama.cpp's numerics and
    a faster decode; ``"int16"``: x quantized per 32 elements to 16 bits (d = max|x| / 32639) and the same integer dot
    products (AVX-512 VNNI or AVX2), the float path's numerics to a few 1e-5 and a faster decode than float32. A
    GPU takes x as it is (MLX's kernels). ``draft_model``: a smaller model of the same vocabulary (a name or path,
    loaded with the same options and context length) whose greedy drafts the model verifies several tokens per
    pass (speculative decoding, on by default then; ``speculative="off"`` turns it off for one generation).

    Raises:
        ModelNotFoundError: the name resolves to nothing. WeightsError: the file is corrupt.
        UnsupportedError: an architecture we do not run (the message lists those we do).
        InvalidRequestError: float16 for an architecture whose activations outgrow it; activations none of float32,
            int8, int16; a draft model of another vocabulary. UnsupportedError: int8 or int16 activations where
            they cannot run (a GPU; a CPU without AVX-512 VNNI and AVX2).
    """
    resolved = Store().resolve(model, pull=pull, progress=progress)
    if is_embedding_checkpoint(resolved.path):
        return EmbeddingModel(resolved.name, resolved.path, source=resolved.source, license=resolved.license,
                              device=device, dtype=dtype)
    loaded = Model(resolved.name, resolved.path, source=resolved.source, license=resolved.license, device=device,
                   dtype=dtype, context_length=context_length, kv_bits=kv_bits, requantize=requantize,
                   parallel=parallel, transport=transport, mmproj=mmproj, activations=activations)
    if draft_model is not None:
        try:
            loaded.attach_draft(load(draft_model, device=device, dtype=dtype, context_length=loaded.context_length,
                                     pull=pull, progress=progress, kv_bits=kv_bits, activations=activations))
        except BaseException:
            loaded.close()
            raise
    return loaded


def _as_model(model: "Model | str") -> Model:
    return model if isinstance(model, Model) else load(model)


def generate(model: "Model | str", prompt: str, **options: Any) -> str:
    """``load(model).generate(prompt, **options)``."""
    return _as_model(model).generate(prompt, **options)


def stream(model: "Model | str", prompt: str, **options: Any) -> Iterator["str | GenerationStats"]:
    """``load(model).stream(prompt, **options)``."""
    return _as_model(model).stream(prompt, **options)


def chat(model: "Model | str", messages: list[dict[str, str]], **options: Any) -> str:
    """``load(model).chat(messages, **options)``."""
    return _as_model(model).chat(messages, **options)
