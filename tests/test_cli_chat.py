"""``mlx-engine chat`` driven through a pseudo-terminal (pexpect), its screen read back through a terminal emulator
(pyte): two turns, a ``/set``, a Ctrl-C in the middle of an answer followed by another turn, and ``/bye``."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

pexpect = pytest.importorskip("pexpect")
pyte = pytest.importorskip("pyte")

REPO = Path(__file__).resolve().parents[1]
MLX_ENGINE = Path(sys.executable).parent / "mlx-engine"
COLS, ROWS = 110, 150


class Terminal:
    """A child process in a pseudo-terminal, and the screen it draws."""

    def __init__(self, args: list[str], env: dict):
        self.screen = pyte.Screen(COLS, ROWS)
        self.stream = pyte.Stream(self.screen)
        self.raw = []
        self.child = pexpect.spawn(str(MLX_ENGINE), args, cwd=str(REPO), env=env, encoding="utf-8",
                                   dimensions=(ROWS, COLS), timeout=5)
        self.child.logfile_read = self

    # pexpect calls these with everything it reads
    def write(self, data: str) -> None:
        self.raw.append(data)
        self.stream.feed(data)

    def flush(self) -> None:
        pass

    def lines(self) -> list[str]:
        return [line.rstrip() for line in self.screen.display]

    def text(self) -> str:
        return "\n".join(line for line in self.lines() if line)

    def pump(self, seconds: float = 0.05) -> None:
        try:
            self.child.read_nonblocking(size=65536, timeout=seconds)
        except pexpect.TIMEOUT:
            pass
        except pexpect.EOF:
            time.sleep(seconds)

    def wait(self, predicate, timeout: float, what: str):
        deadline = time.monotonic() + timeout
        while True:
            result = predicate()
            if result:
                return result
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}; screen:\n{self.text()}")
            if not self.child.isalive():
                self.pump(0.01)
                result = predicate()
                if result:
                    return result
                raise AssertionError(f"the chat exited while waiting for {what}; screen:\n{self.text()}")
            self.pump()

    def prompts(self) -> list[int]:
        """Rows that hold an empty input prompt."""
        return [i for i, line in enumerate(self.lines()) if line.startswith(">>>") and
                line[3:].strip() in ("", "Send a message (/? for help)")]

    def wait_prompt(self, timeout: float, what: str, after: int = -1) -> int:
        """Wait for an empty prompt below row ``after``, on the last row in use; returns its row."""
        def ready():
            rows = [r for r in self.prompts() if r > after]
            used = [i for i, line in enumerate(self.lines()) if line]
            return rows and used and rows[-1] == used[-1] and rows[-1] + 1
        return self.wait(ready, timeout, what) - 1

    def type(self, text: str) -> None:
        self.child.send(text + "\r")


def _answer_after(lines: list[str], prompt_row: int, upto: int | None = None) -> str:
    """The text the model wrote after the message typed on ``prompt_row``."""
    return "\n".join(lines[prompt_row + 1:upto]).strip()


def test_chat_in_a_terminal(home_with_smollm2):
    home = home_with_smollm2
    env = {**os.environ, "TERM": "xterm", "PROMPT_TOOLKIT_NO_CPR": "1", "COLUMNS": str(COLS), "LINES": str(ROWS)}
    t = Terminal(["chat", "smollm2:135m", "--temperature", "0", "--max-tokens", "600"], env)
    try:
        t.wait(lambda: "Type /? for help" in t.text(), 120, "the banner")
        assert "smollm2:135m (llama, 135M, Q4_1) on mlx" in t.text()
        row = t.wait_prompt(30, "the first prompt")

        # turn 1
        t.type("What is the capital of France?")
        t.wait(lambda: t.lines()[row].startswith(">>> What is the capital of France?"), 10, "the echo of turn 1")
        next_row = t.wait_prompt(120, "the end of answer 1", after=row)
        answer1 = _answer_after(t.lines(), row, next_row)
        assert "Paris" in answer1, t.text()
        row = next_row

        # /set
        t.type("/set max_tokens 400")
        t.wait(lambda: "Set max_tokens to 400." in t.text(), 10, "the /set reply")
        row = t.wait_prompt(10, "the prompt after /set", after=row)

        # turn 2, stopped with Ctrl-C once the answer has begun; text typed meanwhile waits for the next prompt
        t.type("Write a very long story about a dragon who learns to cook.")
        t.wait(lambda: len(_answer_after(t.lines(), row)) > 20, 120, "the beginning of answer 2")
        t.child.send("Tell me more")
        t.pump(0.3)
        t.child.sendintr()
        notice = "[stopped; the partial answer stays in the conversation]"
        t.wait(lambda: notice in t.lines(), 20, "the stop after Ctrl-C, on a line of its own")
        typed = t.wait(lambda: [i for i, line in enumerate(t.lines()) if i > row and line == ">>> Tell me more"],
                       20, "the prompt after Ctrl-C, holding what was typed during the answer")[-1]
        stopped = _answer_after(t.lines(), row, typed)
        assert stopped.endswith("\n" + notice) and "Tell me more" not in stopped and "^C" not in stopped
        partial = stopped[: -len(notice)].strip()
        assert len(partial) > 20
        # far fewer than the 400 tokens asked for: the answer was cut in the middle
        assert len(partial.split()) < 200, partial
        t.child.send("\x15")  # Ctrl-U empties the prompt
        row = t.wait_prompt(10, "the emptied prompt", after=typed - 1)

        # turn 3: the conversation goes on
        t.type("What is the capital of France?")
        next_row = t.wait_prompt(120, "the end of answer 3", after=row)
        answer3 = _answer_after(t.lines(), row, next_row)
        assert answer3 and "Paris" in answer3, t.text()
        row = next_row

        t.type("/show")
        t.wait(lambda: "Conversation: 3 messages from you" in t.text(), 10, "/show")
        assert "max_tokens=400" in t.text() and "temperature=0.0" in t.text()
        t.wait_prompt(10, "the prompt after /show", after=row)

        t.type("/bye")
        t.child.expect(pexpect.EOF, timeout=20)
        t.child.close()
        assert t.child.exitstatus == 0
    finally:
        if t.child.isalive():
            t.child.terminate(force=True)

    history = (home / "chat_history").read_text()
    assert "+What is the capital of France?" in history and "+/set max_tokens 400" in history
    assert "Traceback" not in "".join(t.raw)


def test_chat_ctrl_d_exits(home_with_smollm2):
    env = {**os.environ, "TERM": "xterm", "PROMPT_TOOLKIT_NO_CPR": "1"}
    t = Terminal(["chat", "--no-history"], env)
    try:
        t.wait(lambda: "Type /? for help" in t.text(), 120, "the banner")
        t.wait_prompt(30, "the prompt")
        t.child.sendcontrol("c")  # Ctrl-C at the prompt does not exit
        t.wait(lambda: "Use Ctrl-D or /bye to exit." in t.text(), 10, "the Ctrl-C hint")
        t.child.sendcontrol("d")
        t.child.expect(pexpect.EOF, timeout=20)
        t.child.close()
        assert t.child.exitstatus == 0
    finally:
        if t.child.isalive():
            t.child.terminate(force=True)
    assert not (home_with_smollm2 / "chat_history").exists()
