"""The ``chat`` command's read-eval-print loop.

On a terminal it reads with prompt_toolkit (line editing, history saved in the store's ``chat_history``); otherwise it
reads plain lines from stdin, so ``printf 'hi\\n/bye\\n' | mlx-engine chat`` works. Answers stream as they are
generated; Ctrl-C stops an answer (the partial answer stays in the conversation, as the ChatSession keeps it) and
Ctrl-D or ``/bye`` exits.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
import time
from pathlib import Path

import click

from mlx_engine.api import IMAGE_SUFFIXES, GenerationOptions, load_image
from mlx_engine.cli.streaming import StopOnInterrupt, ThinkingView, context_full_notice, describe_model, stream_to
from mlx_engine.errors import EngineError, InvalidOptionError

HELP = """\
Commands:
  /help, /?              this help
  /bye                   exit (Ctrl-D too)
  /clear                 forget the conversation (the system prompt stays)
  /system [TEXT]         set the system prompt (without TEXT: show it)
  /set PARAMETER VALUE   set an option: temperature, top_k, top_p, min_p, repeat_penalty,
                         seed, max_tokens, verbose (on/off); /set alone shows them
  /set think [LEVEL]     a reasoning model thinks (LEVEL: low, medium, high); /set nothink: it
                         answers at once; /set hidethinking, /set showthinking
  /show                  the model and the current options
  /regen                 answer the last message again
  /save FILE             save the conversation (messages and options, JSON)
  /load FILE             load a conversation saved with /save
  /image PATH            attach an image to the next message (models that read images); a path to an
                         image file typed in a message is attached too
Write \"\"\" to begin a multiline message and \"\"\" again to end it.
Ctrl-C stops an answer and keeps the conversation; Ctrl-D or /bye exits."""


def _is_file(word: str) -> bool:
    try:
        return Path(word).expanduser().is_file()
    except (OSError, ValueError):
        return False


def _balanced_quotes(text: str) -> bool:
    try:
        shlex.split(text)
    except ValueError:
        return False
    return True


def _parse_bool(v: str) -> bool:
    low = v.strip().lower()
    if low in ("1", "on", "true", "yes", "y"):
        return True
    if low in ("0", "off", "false", "no", "n"):
        return False
    raise ValueError(f"expected on or off, not {v!r}")


def _seed(v: str) -> int | None:
    return None if v.strip().lower() in ("none", "random", "off") else int(v)


#: how ``/set`` reads each value; :meth:`mlx_engine.GenerationOptions.parse` then checks it, as for every door
PARAMETERS = {
    "temperature": float, "top_k": int, "top_p": float, "min_p": float, "repeat_penalty": float,
    "repeat_last_n": int, "presence_penalty": float, "frequency_penalty": float, "seed": _seed, "max_tokens": int,
}
ALIASES = {"num_predict": "max_tokens", "temp": "temperature"}


class TypeAhead:
    """While an answer streams on a terminal: keys typed are not echoed into the answer (the terminal's echo and
    line editing are off; Ctrl-C still signals), and what was typed is kept in :attr:`text` to fill the next
    prompt, instead of being thrown away when the prompt takes the terminal. Does nothing off a terminal."""

    def __init__(self, stdin) -> None:
        self.stdin = stdin
        self.text = ""
        self._fd = None
        self._saved = None

    def __enter__(self) -> "TypeAhead":
        try:
            import termios

            fd = self.stdin.fileno()
            self._saved = termios.tcgetattr(fd)
            quiet = termios.tcgetattr(fd)
            quiet[3] &= ~(termios.ECHO | termios.ICANON)  # lflag; ISIG stays, so Ctrl-C is still SIGINT,
            quiet[3] |= termios.NOFLSH  # and it no longer throws away what was typed before it
            quiet[6][termios.VMIN], quiet[6][termios.VTIME] = 0, 0
            termios.tcsetattr(fd, termios.TCSANOW, quiet)
            self._fd = fd
        except (ImportError, OSError, ValueError, AttributeError):  # not a terminal (or no termios): nothing to do
            self._fd = None
        return self

    def __exit__(self, *exc) -> None:
        if self._fd is None:
            return
        import termios

        typed = b""
        try:
            while len(typed) < 65536:  # what is waiting now; VMIN=0 makes read return at once when nothing is
                chunk = os.read(self._fd, 4096)
                if not chunk:
                    break
                typed += chunk
        except OSError:
            pass
        finally:
            termios.tcsetattr(self._fd, termios.TCSANOW, self._saved)  # TCSANOW: nothing pending is discarded
        text = typed.decode("utf-8", errors="replace")
        text = re.sub(r"\x1b\[[0-?]*[ -/]*[@-~]|[\x00-\x08\x0b-\x1f\x7f]", "", text)  # arrows, controls
        lines = [line for line in text.replace("\r", "\n").split("\n") if line.strip()]
        self.text = " ".join(lines)


class ChatRepl:
    """An interactive conversation with ``model`` (an :class:`mlx_engine.api.Model`)."""

    def __init__(self, model, *, system: str | None = None, options: dict | None = None, verbose: bool = False,
                 history_file: Path | None = None, stdin=None, stdout=None, hide_thinking: bool = False):
        self.model = model
        self.session = model.chat_session(system=system, **(options or {}))
        self.verbose = verbose
        self.hide_thinking = hide_thinking
        self.history_file = history_file
        self.stdin = stdin if stdin is not None else sys.stdin
        self.out = stdout if stdout is not None else sys.stdout
        self.interactive = bool(self.stdin is not None and self.stdin.isatty() and self.out.isatty())
        self._prompt_session = None
        self._typed_ahead = ""  # keys typed during the last answer: the next prompt starts with them
        self._images: list[Path] = []  # attached with /image, sent with the next message

    # --------------------------------------------------------------------------------------------------- input

    def _make_prompt_session(self):
        from prompt_toolkit import PromptSession
        from prompt_toolkit.history import FileHistory, InMemoryHistory

        history = InMemoryHistory()
        if self.history_file is not None:
            try:
                self.history_file.parent.mkdir(parents=True, exist_ok=True)
                history = FileHistory(str(self.history_file))
            except OSError:
                pass
        return PromptSession(history=history)

    def _read_line(self, prompt: str) -> str:
        """One line; raises EOFError at the end of input and KeyboardInterrupt on Ctrl-C at the prompt."""
        if self.interactive:
            if self._prompt_session is None:
                self._prompt_session = self._make_prompt_session()
            from prompt_toolkit.formatted_text import HTML

            placeholder = HTML("<style fg='ansibrightblack'>Send a message (/? for help)</style>") \
                if prompt == ">>> " else None
            typed, self._typed_ahead = self._typed_ahead, ""
            return self._prompt_session.prompt(prompt, placeholder=placeholder, default=typed)
        line = self.stdin.readline()
        if not line:
            raise EOFError
        return line.rstrip("\r\n")

    def read_message(self) -> str:
        """A message: one line, or the lines between ``\"\"\"`` marks (the marks removed)."""
        line = self._read_line(">>> ")
        if not line.lstrip().startswith('"""'):
            return line
        first = line.lstrip()[3:]
        if first.rstrip().endswith('"""') and first.strip():
            return first.rstrip()[:-3]
        lines = [first] if first else []
        while True:
            more = self._read_line("... ")
            if more.rstrip().endswith('"""'):
                lines.append(more.rstrip()[:-3])
                break
            lines.append(more)
        text = "\n".join(lines)
        return text if text.strip() else ""

    # ---------------------------------------------------------------------------------------------------- loop

    def echo(self, text: str = "", err: bool = False) -> None:
        click.echo(text, err=err)

    def run(self) -> None:
        if self.interactive:
            self.echo(f"{describe_model(self.model)}")
            if not self.model.has_chat_template:
                self.echo(f"{self.model.name} is a base model without a chat template: it continues your text.")
            self.echo("Type /? for help, Ctrl-D or /bye to exit.")
        while True:
            try:
                text = self.read_message()
            except KeyboardInterrupt:
                self.echo("Use Ctrl-D or /bye to exit.")
                continue
            except EOFError:
                if self.interactive:
                    self.echo()
                return
            if not text.strip():
                continue
            try:
                if text.startswith("/"):
                    if not self.command(text):
                        return
                else:
                    text, images = self._take_images(text)
                    self.answer(self.session.send(text, images=images or None))
            except EngineError as e:
                self.echo(f"Error: {e}", err=True)
            except KeyboardInterrupt:  # a second Ctrl-C while generating
                self.echo("\n^C", err=True)
            except Exception as e:  # a defect of ours: say so, and keep the conversation
                self.echo(f"Error (internal, please report): {type(e).__name__}: {e}", err=True)

    def answer(self, generator) -> None:
        with StopOnInterrupt() as stop, TypeAhead(self.stdin if self.interactive else None) as typed:
            stats, text, interrupted = stream_to(self.out, generator, stop,
                                                 ThinkingView(self.out, hide=self.hide_thinking))
        self._typed_ahead = typed.text
        if interrupted:  # on a line of its own, after the partial answer
            self.out.write(("" if text.endswith("\n") else "\n") +
                           "[stopped; the partial answer stays in the conversation]\n")
        elif not text.endswith("\n"):
            self.out.write("\n")
        self.out.flush()
        if self.verbose and stats is not None:
            self.echo(stats.summary(), err=True)
        if stats is not None and getattr(stats, "context_full", False):
            self.echo(context_full_notice(self.model), err=True)
        if self.interactive:
            self.out.write("\n")
            self.out.flush()

    # ------------------------------------------------------------------------------------------------ commands

    def command(self, line: str) -> bool:
        """Run a slash command; False means exit."""
        cmd, _, arg = line.strip().partition(" ")
        cmd = cmd.lower()
        arg = arg.strip()
        if cmd in ("/bye", "/exit", "/quit"):
            return False
        if cmd in ("/help", "/?"):
            self.echo(HELP)
        elif cmd == "/clear":
            self.session.clear()
            self.echo("Cleared the conversation.")
        elif cmd == "/system":
            if arg:
                self.session.set_system(arg)
                self.echo("Set the system prompt.")
            else:
                self.echo(f"System prompt: {self._system() or '(none)'}")
        elif cmd == "/set":
            self._set(arg)
        elif cmd == "/show":
            self._show()
        elif cmd == "/regen":
            self.answer(self.session.regenerate())
        elif cmd == "/image":
            path = Path(arg).expanduser()
            if not arg:
                self.echo("Usage: /image PATH")
            elif not path.is_file():
                self.echo(f"Error: no such file: {path}", err=True)
            else:
                load_image(path)  # a file that is not an image is refused now, not with the next message
                self._images.append(path)
                self.echo(f"Attached {path.name} to the next message.")
        elif cmd == "/save":
            if not arg:
                self.echo("Usage: /save FILE")
            else:
                path = Path(arg).expanduser()
                self.session.save(path)
                self.echo(f"Saved the conversation to {path}.")
        elif cmd == "/load":
            if not arg:
                self.echo("Usage: /load FILE")
            else:
                path = Path(arg).expanduser()
                try:
                    found = path.is_file()
                except (OSError, ValueError):
                    found = False
                if not found:
                    self.echo(f"Error: no such file: {path}", err=True)
                    return True
                self.session.load(path)
                n = len([m for m in self.session.messages if m.get("role") != "system"])
                self.echo(f"Loaded {n} messages from {path}.")
                # read the conversation into the KV cache now, so that the next turn runs only its new message
                start = time.perf_counter()
                ran = self.session.prefill()
                if ran:
                    self.echo(f"Read {ran} tokens of it into the context in {time.perf_counter() - start:.1f} s.")
        else:
            self.echo(f"Unknown command {cmd!r}. Type /? for help.")
        return True

    def _take_images(self, text: str) -> tuple[str, list[Path]]:
        """The message without the paths of image files typed (or dropped) into it, and the images attached to it:
        those of /image, then those found in the text (quoted or with backslash-escaped spaces, as terminals paste
        them). Only for a model that reads images; otherwise the text stays as typed."""
        images, self._images = list(self._images), []
        if not getattr(self.model, "reads_images", False):
            if images:
                self.echo("Note: this model does not read images; the attached ones are dropped.", err=True)
            return text, []
        words = shlex.split(text) if _balanced_quotes(text) else text.split()
        found = [w for w in words if Path(w).suffix.lower() in IMAGE_SUFFIXES and _is_file(w)]
        if not found:
            return text, images
        return " ".join(w for w in words if w not in found), images + [Path(w).expanduser() for w in found]

    def _system(self) -> str | None:
        for m in self.session.messages:
            if m.get("role") == "system":
                return m.get("content")
        return None

    def _set(self, arg: str) -> None:
        name, _, value = arg.partition(" ")
        name = name.strip().lower().replace("-", "_")
        name = ALIASES.get(name, name)
        value = value.strip()
        if not name:
            opts = {k: v for k, v in self.session.options.items()}
            opts["verbose"] = self.verbose
            self.echo("Options: " + ", ".join(f"{k}={v}" for k, v in sorted(opts.items())))
            return
        if name == "verbose":
            try:
                self.verbose = _parse_bool(value) if value else True
            except ValueError as e:
                self.echo(f"Error: verbose: {e}", err=True)
                return
            self.echo(f"Set verbose to {'on' if self.verbose else 'off'}.")
            return
        if name == "quiet":
            self.verbose = False
            self.echo("Set verbose to off.")
            return
        if name == "system":
            self.command(f"/system {value}")
            return
        if name in ("think", "nothink", "hidethinking", "showthinking"):
            self._set_thinking(name, value)
            return
        if name not in PARAMETERS:
            known = [*PARAMETERS, "verbose", "think", "nothink"]
            self.echo(f"Unknown parameter {name!r}. Parameters: {', '.join(known)}.")
            return
        if not value:
            self.echo(f"Usage: /set {name} VALUE")
            return
        try:
            converted = PARAMETERS[name](value)
        except ValueError as e:
            self.echo(f"Error: {name}: invalid value {value!r} ({e})", err=True)
            return
        try:
            GenerationOptions.parse({**self.session.options, name: converted})
        except InvalidOptionError as e:
            self.echo(f"Error: {name}: invalid value {value!r} ({e.rule})", err=True)
            return
        if converted is None:
            self.session.options.pop(name, None)
        else:
            self.session.options[name] = converted
        self.echo(f"Set {name} to {converted}.")

    def _set_thinking(self, name: str, value: str) -> None:
        """``/set think [LEVEL]``, ``/set nothink`` (the template's ``enable_thinking``), ``/set hidethinking``,
        ``/set showthinking`` (whether the thinking is shown)."""
        if name in ("hidethinking", "showthinking"):
            self.hide_thinking = name == "hidethinking"
            self.echo(f"Set thinking to {'hidden' if self.hide_thinking else 'shown'}.")
            return
        think: bool | str = False
        if name == "think":
            try:
                think = _parse_bool(value) if value else True
            except ValueError:
                think = value.lower()  # a level (low, medium, high), checked below
        try:
            self.model.template_vars(think)  # a bad level, or a model that does not think, is refused now
        except EngineError as e:
            self.echo(f"Error: {e}", err=True)
            return
        self.session.options["think"] = think
        self.echo("Set thinking " + ("off." if think is False else f"on{'' if think is True else f' ({think})'}."))

    def _show(self) -> None:
        info = dict(getattr(self.model, "info", {}) or {})
        self.echo(f"Model: {describe_model(self.model)}")
        for key in ("context_length", "license", "source", "path"):
            if info.get(key) is not None:
                value = str(info[key]).strip().splitlines()[0] if key == "license" else info[key]
                if key == "context_length" and getattr(self.model, "context_length", value) != value:
                    value = f"{self.model.context_length} (the model's: {value})"
                self.echo(f"  {key.replace('_', ' ')}: {value}")
        self.echo(f"  chat template: {'yes' if self.model.has_chat_template else 'none (base model)'}")
        self.echo(f"System prompt: {self._system() or '(none)'}")
        opts = {k: v for k, v in self.session.options.items()}
        opts["verbose"] = self.verbose
        self.echo("Options: " + ", ".join(f"{k}={v}" for k, v in sorted(opts.items())))
        turns = len([m for m in self.session.messages if m.get("role") == "user"])
        self.echo(f"Conversation: {turns} messages from you")
        used = self.session.tokens_used() if hasattr(self.session, "tokens_used") else None
        if used is not None:
            limit = self.model.context_length
            self.echo(f"Context: {used} of {limit} tokens used ({100 * used / limit:.0f}%)")
