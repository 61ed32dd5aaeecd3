"""Tool calling: tools offered to the model through its chat template, tool calls parsed from what it writes, and a
grammar that makes it write one when the caller requires it.

Two forms of call, chosen by the model's chat template:

- ``hermes``: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, one block per call. Qwen3's
  template asks for this form (as Qwen2.5's and NousResearch's Hermes do).
- ``llama3``: a JSON object ``{"name": ..., "parameters": {...}}`` as the whole answer, optionally after
  ``<|python_tag|>``: what Llama 3.1 / 3.2's templates ask for.
- ``harmony`` (gpt-oss): a message to ``functions.NAME`` on the ``commentary`` channel whose body is the arguments'
  JSON, ended by ``<|call|>``; :class:`~mlx_engine.models.text.reasoning.HarmonyParser` passes it into the answer in
  one form (``<|start|>assistant to=functions.NAME<|channel|>commentary<|message|>{...}<|call|>``). The template
  renders one call per assistant message and names each ``tool`` result after the call before it, so an assistant
  message of several calls is written as one message per call, each followed by its result (matched by
  ``tool_call_id``, else in order), as the harmony format writes them.

A template that handles ``tools`` itself (it mentions them) gets them as transformers passes them
(``tools=[{"type": "function", "function": {...}}]``) and renders assistant ``tool_calls`` and ``tool`` messages its
own way. A template that does not (SmolLM2's ChatML, Gemma 3's, a base model's default) gets the **generic form**,
documented here: the tools are described in the system message in the ``hermes`` form (the text Qwen's and Hermes'
templates write), earlier assistant calls are written back as ``<tool_call>`` blocks and ``tool`` results as a user
turn holding ``<tool_response>`` blocks.

With ``tool_choice`` ``required`` or a named function, the answer is constrained by a grammar (llguidance's Lark with
an embedded JSON Schema): exactly one call, to one of the offered functions (or the named one), whose arguments
validate against the function's ``parameters`` schema, read strictly (no properties beyond those it declares, unless
it says ``additionalProperties``).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from mlx_engine.errors import InvalidRequestError
from mlx_engine.models.text.constraint import ResponseFormat, parse_response_format
from mlx_engine.models.text.reasoning import CALL_END, CALL_OPEN

__all__ = ["ToolCall", "ToolStyle", "check_tools", "tool_style", "prepare_messages", "parse_tool_calls",
           "tool_choice_format", "may_be_tool_call"]

_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"
_HERMES_CALL = re.compile(re.escape(_HERMES_OPEN) + r"\s*(.*?)\s*(?:" + re.escape(_HERMES_CLOSE) + r"|$)", re.S)
_HARMONY_OPEN = CALL_OPEN.split("{}")[0]  # "<|start|>assistant to="
_HARMONY_CALL = re.compile(re.escape(_HARMONY_OPEN) + r"functions\.([^<\s]+)<\|channel\|>[^<]*<\|message\|>(.*?)"
                           + re.escape(CALL_END), re.S)
_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")


@dataclass
class ToolCall:
    """One call the model made: the function's ``name``, its ``arguments`` (a dict) and an ``id`` (``call_...``)."""

    name: str
    arguments: dict[str, Any]
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def openai(self, index: int | None = None) -> dict[str, Any]:
        """OpenAI's ``tool_calls`` item (``arguments`` as a JSON string)."""
        out = {"id": self.id, "type": "function",
               "function": {"name": self.name, "arguments": json.dumps(self.arguments, ensure_ascii=False)}}
        return out if index is None else {"index": index, **out}


@dataclass(frozen=True)
class ToolStyle:
    """How a model's template takes tools: ``form`` (``hermes`` or ``llama3``) and ``native`` (the template renders
    tools itself; otherwise the generic form above)."""

    form: str
    native: bool


def tool_style(template: str | None) -> ToolStyle:
    """The tool style of a chat template's source (None: a model without one)."""
    if not template or "tools" not in template:
        return ToolStyle("hermes", False)
    if "<|channel|>" in template and "<|call|>" in template:
        return ToolStyle("harmony", True)
    if _HERMES_OPEN in template:
        return ToolStyle("hermes", True)
    if '"parameters"' in template or "ipython" in template or _PYTHON_TAG in template:
        return ToolStyle("llama3", True)
    return ToolStyle("hermes", True)


def check_tools(tools: Any) -> list[dict[str, Any]]:
    """OpenAI's / ollama's ``tools`` checked and normalized to ``[{"type": "function", "function": {"name",
    "description", "parameters"}}]`` (what transformers gives templates). A bare function dict is accepted too.

    Raises:
        InvalidRequestError: not a list, a tool that is not a function, a missing or invalid name (letters, digits,
            ``_.:-``, at most 64), parameters that are not a JSON Schema object, or two tools of one name.
    """
    if not isinstance(tools, (list, tuple)) or not tools:
        raise InvalidRequestError("tools must be a non-empty list of {'type': 'function', 'function': {...}}")
    out, names = [], set()
    for t in tools:
        fn = t.get("function") if isinstance(t, Mapping) and t.get("type", "function") == "function" else None
        if fn is None and isinstance(t, Mapping) and "name" in t:
            fn = t
        if not isinstance(fn, Mapping):
            raise InvalidRequestError(f"a tool must be {{'type': 'function', 'function': {{...}}}}, got {t!r:.120}")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise InvalidRequestError(f"a tool's function needs a name of letters, digits, '_', '.', ':' or '-' (at "
                                      f"most 64), got {name!r:.80}")
        if name in names:
            raise InvalidRequestError(f"two tools are named {name!r}")
        names.add(name)
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(params, Mapping):
            raise InvalidRequestError(f"tool {name!r}: parameters must be a JSON Schema object")
        parse_response_format({"type": "json_schema", "json_schema": {"name": name, "schema": dict(params)}})
        desc = fn.get("description")
        out.append({"type": "function", "function": {"name": name, "description": desc if isinstance(desc, str)
                                                     else "", "parameters": dict(params)}})
    return out


def _arguments(value: Any) -> dict[str, Any]:
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else {}
        except ValueError:
            raise InvalidRequestError(f"a tool call's arguments are not JSON: {value[:80]!r}") from None
    if not isinstance(value, Mapping):
        raise InvalidRequestError(f"a tool call's arguments must be an object, got {value!r:.80}")
    return dict(value)


def _calls_of(message: Mapping[str, Any]) -> list[dict[str, Any]]:
    calls = []
    for c in message.get("tool_calls") or []:
        fn = c.get("function", c) if isinstance(c, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise InvalidRequestError(f"a tool call must have a function name, got {c!r:.120}")
        calls.append({"name": fn["name"], "arguments": _arguments(fn.get("arguments", {}))})
    return calls


def _hermes_block(call: Mapping[str, Any]) -> str:
    return f"{_HERMES_OPEN}\n{json.dumps(call, ensure_ascii=False)}\n{_HERMES_CLOSE}"


def _hermes_system(tools: list[dict[str, Any]]) -> str:
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with "
            f"function signatures within <tools></tools> XML tags:\n<tools>\n{listed}\n</tools>\n\nFor each function "
            "call, return a json object with function name and arguments within <tool_call></tool_call> XML "
            'tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def prepare_messages(messages: Sequence[Mapping[str, Any]], tools: list[dict[str, Any]] | None,
                     style: ToolStyle) -> list[dict[str, Any]]:
    """Messages for the template: assistant ``tool_calls`` with ``arguments`` as dicts (OpenAI sends JSON strings)
    and, for the generic form, tools in the system message, calls as ``<tool_call>`` blocks in the assistant's
    content and ``tool`` results as ``<tool_response>`` blocks in a user turn.

    Raises:
        InvalidRequestError: a malformed tool call or ``tool`` message.
    """
    out: list[dict[str, Any]] = []
    for m in messages:
        m = dict(m)
        calls = _calls_of(m)
        if m.get("role") == "tool" and not isinstance(m.get("content"), str):
            raise InvalidRequestError("a tool message's content must be a string (the tool's result)")
        if style.native:
            if calls:
                m["tool_calls"] = [{"type": "function", "function": c, **({"id": t["id"]} if isinstance(t, Mapping)
                                                                          and "id" in t else {})}
                                   for c, t in zip(calls, m["tool_calls"])]
                m["content"] = m.get("content") or ""
            out.append(m)
            continue
        if calls:
            text = (m.get("content") or "").strip()
            m = {"role": "assistant", "content": "\n".join(([text] if text else []) + [_hermes_block(c)
                                                                                       for c in calls])}
        elif m.get("role") == "tool":
            block = f"<tool_response>\n{m['content']}\n</tool_response>"
            if out and out[-1]["role"] == "user" and out[-1].get("_tool"):
                out[-1]["content"] += "\n" + block
                continue
            m = {"role": "user", "content": block, "_tool": True}
        out.append(m)
    if style.form == "harmony":
        out = _one_call_each(out)
    for m in out:
        m.pop("_tool", None)
    if tools and not style.native:
        system = _hermes_system(tools)
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{system}".strip()}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out


def _one_call_each(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """An assistant message of several calls as one message per call (the text and thinking on the first), each
    followed by its ``tool`` result among the messages after it (by ``tool_call_id``, else in order)."""
    out: list[dict[str, Any]] = []
    i = 0
    while i < len(messages):
        m = messages[i]
        calls = m.get("tool_calls") or []
        i += 1
        if m.get("role") != "assistant" or len(calls) < 2:
            out.append(m)
            continue
        results = []
        while i < len(messages) and messages[i].get("role") == "tool":
            results.append(messages[i])
            i += 1
        by_id = {r.get("tool_call_id"): r for r in results if r.get("tool_call_id") is not None}
        rest = [r for r in results if r.get("tool_call_id") not in by_id or r.get("tool_call_id") is None]
        for k, call in enumerate(calls):
            out.append({**(m if k == 0 else {"role": "assistant", "content": ""}), "tool_calls": [call]})
            result = by_id.pop(call.get("id"), None) if call.get("id") in by_id else (rest.pop(0) if rest else None)
            if result is not None:
                out.append(result)
        out.extend(list(by_id.values()) + rest)
    return out


def _opener(style: ToolStyle) -> str:
    return _HARMONY_OPEN if style.form == "harmony" else _HERMES_OPEN


def may_be_tool_call(text: str, style: ToolStyle) -> bool:
    """Whether an answer beginning with ``text`` may still turn out to be a tool call (a streaming server holds such
    text back until it knows)."""
    head = text.lstrip()
    if style.form == "llama3":
        return head == "" or head.startswith(("{", _PYTHON_TAG)) or _PYTHON_TAG.startswith(head)
    opener = _opener(style)
    return head == "" or head.startswith(opener) or opener.startswith(head)


def call_start(text: str, style: ToolStyle) -> int | None:
    """Where in ``text`` (plain text already streamed past) a tool call may begin: the first ``<tool_call>`` tag, or
    the start of a partial one at the very end; None when there is none. Llama 3's form is a whole answer, never a
    call after text: None."""
    if style.form == "llama3":
        return None
    opener = _opener(style)
    i = text.find(opener)
    if i >= 0:
        return i
    for k in range(min(len(opener) - 1, len(text)), 0, -1):
        if opener.startswith(text[-k:]):
            return len(text) - k
    return None


def parse_tool_calls(text: str, style: ToolStyle,
                     names: set[str] | None = None) -> tuple[str, list[ToolCall]]:
    """Split an answer into its plain text and the tool calls in it (``names``: the offered functions; a call to
    another name, or one that is not valid JSON, stays text). Returns ``(text, calls)``."""
    calls: list[ToolCall] = []

    def call(obj: Any) -> ToolCall | None:
        if not isinstance(obj, Mapping) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                return None
        if not isinstance(args, Mapping) or (names is not None and obj["name"] not in names):
            return None
        return ToolCall(obj["name"], dict(args))

    if style.form == "llama3":
        body = text.strip().removeprefix(_PYTHON_TAG).strip()
        if body.startswith("{"):
            parts = [p for p in re.split(r"\s*;\s*(?=\{)", body) if p]
            found = []
            for p in parts:
                try:
                    found.append(call(json.loads(p)))
                except ValueError:
                    found.append(None)
            if found and all(found):
                return "", found
        return text, []
    def found() -> Iterator[tuple[re.Match, Any]]:
        """Each call-shaped block and the object it holds (a block that is not JSON: skipped)."""
        if style.form == "harmony":
            for mo in _HARMONY_CALL.finditer(text):
                yield mo, {"name": mo.group(1), "arguments": mo.group(2)}
            return
        for mo in _HERMES_CALL.finditer(text):
            try:
                yield mo, json.loads(mo.group(1))
            except ValueError:
                continue

    rest, pos = [], 0
    for mo, obj in found():
        c = call(obj)
        if c is None:
            continue
        rest.append(text[pos:mo.start()])
        pos = mo.end()
        calls.append(c)
    rest.append(text[pos:])
    return "".join(rest).strip() if calls else text, calls

_COMPACT = {"x-guidance": {"whitespace_flexible": False}}  # JSON without free whitespace: a model that may pad, pads


def _strict(params: dict[str, Any]) -> dict[str, Any]:
    # the arguments are the declared parameters (OpenAI's strict mode): a small model left free to add properties
    # adds them until max_tokens
    if "properties" in params and "additionalProperties" not in params:
        return {**params, "additionalProperties": False}
    return params


def tool_choice_format(tools: list[dict[str, Any]], choice: Any, style: ToolStyle) -> ResponseFormat | None:
    """The grammar that forces one call for ``tool_choice`` ``required`` or ``{"type": "function", "function":
    {"name": ...}}`` (ollama and OpenAI spell it alike); None for ``auto`` and ``none``.

    Raises:
        InvalidRequestError: an unknown choice, or a named function that is not among the tools.
    """
    if choice is None or choice in ("auto", "none"):
        return None
    if choice == "required":
        chosen = tools
    else:
        name = choice.get("function", {}).get("name") if isinstance(choice, Mapping) else None
        chosen = [t for t in tools if t["function"]["name"] == name]
        if not chosen:
            raise InvalidRequestError(f"tool_choice must be 'auto', 'none', 'required' or a function among the "
                                      f"tools, got {choice!r:.120}")
    if style.form == "harmony":
        # the header's special tokens as tokens (llguidance's <|...|>), the arguments as the function's JSON; as in
        # llama.cpp's gpt-oss grammar, an analysis message may come first (gpt-oss reasons before it calls: a call
        # forced without it loses the reasoning), its text free up to <|end|> (a special token, never text)
        calls = "analysis? (" + " | ".join(f"c{i}" for i in range(len(chosen))) + ")"
        analysis = 'analysis: <|channel|> "analysis" <|message|> /(.|\\n)*/ <|end|> <|start|> "assistant"\n'
        rules = "".join(f'c{i}: <|channel|> "commentary to=functions.{t["function"]["name"]} " <|constrain|> "json" '
                        f'<|message|> %json {json.dumps({**_strict(t["function"]["parameters"]), **_COMPACT})}\n'
                        for i, t in enumerate(chosen))
        return parse_response_format({"type": "grammar", "grammar": f"start: {calls}\n{analysis}{rules}"})
    args_key = "parameters" if style.form == "llama3" else "arguments"

    schema = {"anyOf": [{"type": "object", "additionalProperties": False, "required": ["name", args_key],
                         "properties": {"name": {"const": t["function"]["name"]},
                                        args_key: _strict(t["function"]["parameters"])}} for t in chosen],
              **_COMPACT}
    if style.form == "llama3":
        lark = f"start: call\ncall: %json {json.dumps(schema)}\n"
    else:
        lark = f'start: "{_HERMES_OPEN}\\n" call "\\n{_HERMES_CLOSE}"\ncall: %json {json.dumps(schema)}\n'
    return parse_response_format({"type": "grammar", "grammar": lark})
