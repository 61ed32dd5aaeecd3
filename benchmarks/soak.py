"""Soak run of the server: concurrent clients of mixed traffic for minutes, then what went wrong and what grew.

Not a test: it runs for ``--minutes`` (default 30). It starts a server (or takes ``--url``, with ``--pid`` for its
memory), and ``--clients`` (8) threads send, each in a loop bounded by the deadline and by ``--max-requests``:
OpenAI chat streamed and not, ollama generate streamed and not, images on ``shapes:64``, streams dropped after a
few chunks, bodies dropped halfway, hostile requests (lone surrogates, NUL bytes, huge and NaN ``keep_alive``,
broken JSON), and now and then an unload (``keep_alive: 0``) while the others run. Every request has a timeout.

While it runs it samples the server six times a minute (its RSS; MLX's active and cache memory from ``/status``) and
prints a line a minute (RSS min / median / max), so that a plateau can be told from a leak. At the end it reports,
per kind: requests, answers as expected, expected 4xx, and every other outcome as an error (a 5xx, an answer cut
short, a stream without its finish, a transport error); the RSS growth: the median of the last 5 minutes against the
median of the 5 minutes from ``--rss-mark`` (5), and the RSS once the server is idle; the KV cells in use at the end
against the cells that hold the tokens of the conversations the prefix cache keeps (``/status``: ``cells_in_use``
and ``cells_kept``; any difference is leaked cells), and whether any request was left running. Exit status 1 when
there were errors, a request left running, leaked cells, RSS growth of 5 % or more (judged in runs of at least twice
``--rss-mark``), or (a server it started) a traceback or a 500 in the server's log, or an exit other than 0 or
SIGTERM's (uvicorn re-raises the signal that stopped it).

Example: python benchmarks/soak.py --minutes 3
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

import httpx

HOSTILE = [  # (path, raw body): every one must be answered with a 4xx
    ("/v1/chat/completions", b'{"model": "M", "messages": [{"role": "user", "content": "a\\ud800b"}]}'),
    ("/v1/chat/completions", b'{"model": "M\\udfff", "messages": [{"role": "user", "content": "hi"}]}'),
    ("/v1/chat/completions", b'{"model": "M", "messages": [{"role": "user", "content": "nul\\u0000"}]}'),
    ("/v1/chat/completions", b'{"model": "M", "stop": ["\\ud83d"], "messages": [{"role": "user", "content": "x"}]}'),
    ("/api/generate", b'{"model": "M", "prompt": "hi", "keep_alive": 1' + b"0" * 400 + b"}"),
    ("/api/generate", b'{"model": "M", "prompt": "hi", "keep_alive": 1e300}'),
    ("/api/generate", b'{"model": "M", "prompt": "hi", "keep_alive": "99999999h"}'),
    ("/api/generate", b'{"model": "M", "prompt": "hi", "keep_alive": NaN}'),
    ("/api/generate", b'{"model": "M", "prompt": "a\\ud800", "options": {"num_predict": 4}}'),
    ("/api/chat", b'{"model": "M", "messages": [{"role": "user", "content": "\\u0000"}]}'),
    ("/v1/chat/completions", b'{"model": "M", "messages": [{"role": "user", "content": "x"}'),
    ("/v1/chat/completions", b"[" * 3000),
    ("/v1/completions", b'{"model": "M", "prompt": "x", "max_tokens": -1}'),
]

KINDS = {  # kind: weight
    "openai_chat": 20, "openai_stream": 20, "ollama_generate": 10, "ollama_stream": 10, "image": 6,
    "drop_stream": 10, "drop_body": 5, "hostile": 15, "unload": 1, "ps": 3,
}


class Tally:
    def __init__(self):
        self.lock = threading.Lock()
        self.counts: dict[str, Counter] = defaultdict(Counter)
        self.errors: list[str] = []

    def add(self, kind: str, outcome: str, detail: str = "") -> None:
        with self.lock:
            self.counts[kind][outcome] += 1
            if outcome == "error" and len(self.errors) < 30:
                self.errors.append(f"{kind}: {detail[:300]}")


def sse_finish(lines) -> tuple[str | None, bool, str]:
    """(finish_reason of the last chunk, whether [DONE] came, an error message or "") of an OpenAI stream."""
    finish, done, error = None, False, ""
    for line in lines:
        if not line.startswith("data: "):
            continue
        data = line[6:]
        if data == "[DONE]":
            done = True
            continue
        obj = json.loads(data)
        if "error" in obj:
            error = obj["error"].get("message", "error")
        for c in obj.get("choices", []):
            finish = c.get("finish_reason") or finish
    return finish, done, error


class Client(threading.Thread):
    def __init__(self, i: int, url: str, model: str, deadline: float, max_requests: int, tally: Tally, timeout: float):
        super().__init__(name=f"soak-{i}", daemon=True)
        self.rng = random.Random(i)
        self.url, self.model, self.deadline, self.max_requests = url, model, deadline, max_requests
        self.tally, self.timeout = tally, timeout
        self.http = httpx.Client(base_url=url, timeout=timeout)

    def run(self) -> None:
        kinds, weights = zip(*KINDS.items())
        n = 0
        while time.monotonic() < self.deadline and n < self.max_requests:
            n += 1
            kind = self.rng.choices(kinds, weights)[0]
            try:
                getattr(self, kind)(kind)
            except Exception as e:  # noqa: BLE001 -- a transport error is an outcome to report
                self.tally.add(kind, "error", f"{type(e).__name__}: {e}")
        self.http.close()

    def _prompt(self) -> str:
        return self.rng.choice(["Name a colour.", "What is 2+2?", "Say hello.", "Count to five.",
                                "Write a haiku about rain.", "List three fruits."])

    def _check(self, kind: str, r: httpx.Response, ok: bool, detail: str = "") -> None:
        if r.status_code == 429:  # the queue is full, or the model unloaded between routing and submit: retryable
            self.tally.add(kind, "expected_4xx")
        elif r.status_code == 200 and ok:
            self.tally.add(kind, "ok")
        else:
            self.tally.add(kind, "error", f"{r.status_code} {detail or r.text[:200]}")

    def openai_chat(self, kind: str) -> None:
        r = self.http.post("/v1/chat/completions", json={
            "model": self.model, "max_tokens": self.rng.randint(4, 48),
            "messages": [{"role": "user", "content": self._prompt()}]})
        finish = r.json()["choices"][0]["finish_reason"] if r.status_code == 200 else None
        self._check(kind, r, finish in ("stop", "length"), f"finish_reason {finish}")

    def openai_stream(self, kind: str) -> None:
        with self.http.stream("POST", "/v1/chat/completions", json={
                "model": self.model, "max_tokens": self.rng.randint(4, 48), "stream": True,
                "messages": [{"role": "user", "content": self._prompt()}]}) as r:
            if r.status_code != 200:
                r.read()
                return self._check(kind, r, False)
            finish, done, error = sse_finish(r.iter_lines())
        self._check(kind, r, finish in ("stop", "length") and done and not error,
                    f"finish_reason {finish}, [DONE] {done}, error {error!r}")

    def ollama_generate(self, kind: str) -> None:
        r = self.http.post("/api/generate", json={"model": self.model, "prompt": self._prompt(), "stream": False,
                                                  "options": {"num_predict": self.rng.randint(4, 48)}})
        reason = r.json().get("done_reason") if r.status_code == 200 else None
        self._check(kind, r, reason in ("stop", "length"), f"done_reason {reason}")

    def ollama_stream(self, kind: str) -> None:
        with self.http.stream("POST", "/api/generate", json={
                "model": self.model, "prompt": self._prompt(), "options": {"num_predict": self.rng.randint(4, 48)}}) as r:
            if r.status_code != 200:
                r.read()
                return self._check(kind, r, False)
            last = {}
            for line in r.iter_lines():
                if line.strip():
                    last = json.loads(line)
        self._check(kind, r, last.get("done") is True and last.get("done_reason") in ("stop", "length")
                    and "error" not in last, f"last line {last}")

    def image(self, kind: str) -> None:
        r = self.http.post("/v1/images/generations", json={
            "model": "shapes:64", "prompt": "a red circle", "size": "64x64", "steps": 2, "seed": self.rng.randint(0, 99)})
        ok = r.status_code == 200 and base64.b64decode(r.json()["data"][0]["b64_json"])[:8] == b"\x89PNG\r\n\x1a\n"
        self._check(kind, r, ok)

    def drop_stream(self, kind: str) -> None:
        with self.http.stream("POST", "/v1/completions", json={
                "model": self.model, "prompt": "1, 2, 3,", "max_tokens": 200, "stream": True}) as r:
            if r.status_code != 200:
                r.read()
                return self._check(kind, r, False)
            for i, _ in enumerate(r.iter_lines()):
                if i >= self.rng.randint(1, 6):
                    break
        self.tally.add(kind, "ok")

    def drop_body(self, kind: str) -> None:
        host, port = self.url.split("//")[1].rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=self.timeout) as s:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 400\r\n\r\n{\"model\": \"")
        self.tally.add(kind, "ok")

    def hostile(self, kind: str) -> None:
        path, body = self.rng.choice(HOSTILE)
        r = self.http.post(path, content=body.replace(b'"M', b'"' + self.model.encode()),
                           headers={"Content-Type": "application/json"})
        if 400 <= r.status_code < 500 and "Traceback" not in r.text:
            self.tally.add(kind, "expected_4xx")
        else:
            self.tally.add(kind, "error", f"{path} {body[:60]!r} -> {r.status_code} {r.text[:200]}")

    def unload(self, kind: str) -> None:
        r = self.http.post("/api/generate", json={"model": self.model, "prompt": "", "keep_alive": 0})
        self._check(kind, r, r.status_code == 200 and r.json().get("done_reason") == "unload")

    def ps(self, kind: str) -> None:
        r = self.http.get("/api/ps")
        self._check(kind, r, isinstance(r.json().get("models"), list) if r.status_code == 200 else False)


def rss_bytes(pid: int | None) -> int | None:
    """The resident memory of process ``pid`` (Linux /proc, else ``ps``), or None."""
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return int(subprocess.run(["ps", "-o", "rss=", "-p", str(pid)], capture_output=True, text=True,
                                  timeout=10).stdout.strip()) * 1024
    except (OSError, ValueError, subprocess.SubprocessError):
        return None


def server_status(url: str) -> dict:
    """The server's ``/status`` ({} when it does not answer)."""
    try:
        return httpx.get(url + "/status", timeout=30).json()
    except (httpx.HTTPError, ValueError):
        return {}


class Monitor(threading.Thread):
    """Samples the server every ``every`` seconds: its RSS, MLX's active and cache memory (``/status``), and the
    requests answered so far; prints each ``line_every`` seconds' samples as one line (RSS min / median / max).
    ``samples``: (minutes, rss, mlx_active, mlx_cache, requests)."""

    def __init__(self, url: str, pid: int | None, tally: Tally, t0: float, every: float, line_every: float):
        super().__init__(name="soak-monitor", daemon=True)
        self.url, self.pid, self.tally, self.t0, self.every, self.line_every = url, pid, tally, t0, every, line_every
        self.samples: list[tuple[float, int | None, int | None, int | None, int]] = []
        self.done = threading.Event()

    def sample(self) -> tuple:
        mem = server_status(self.url).get("memory", {})
        with self.tally.lock:
            n = sum(sum(c.values()) for c in self.tally.counts.values())
        row = ((time.monotonic() - self.t0) / 60, rss_bytes(self.pid), mem.get("mlx_active"), mem.get("mlx_cache"), n)
        self.samples.append(row)
        return row

    def print_window(self, lo: float, hi: float, label: str = "") -> None:
        rows = [r for r in self.samples if lo <= r[0] < hi]
        rss = [r[1] for r in rows if r[1]]
        if rows:
            print(f"  {label or f'minutes {lo:g}-{hi:g}'}: RSS {fmt(min(rss, default=None))} / "
                  f"{fmt(median(rss))} / {fmt(max(rss, default=None))} (min / median / max of {len(rows)}), "
                  f"MLX active {fmt(median([r[2] for r in rows if r[2] is not None]))}, MLX cache max "
                  f"{fmt(max((r[3] for r in rows if r[3] is not None), default=None))}, {rows[-1][4]} requests",
                  flush=True)

    def run(self) -> None:
        k, line = 1, 1
        while not self.done.wait(max(0.0, self.t0 + k * self.every - time.monotonic())):
            self.sample()
            k += 1
            if k * self.every > line * self.line_every:
                self.print_window((line - 1) * self.line_every / 60, line * self.line_every / 60)
                line += 1

    def median_rss(self, lo: float, hi: float) -> int | None:
        """The median RSS of the samples taken from minute ``lo`` to ``hi``."""
        return median([r[1] for r in self.samples if lo <= r[0] < hi and r[1]])


def median(values: list[int]) -> int | None:
    return sorted(values)[len(values) // 2] if values else None


def start_server(model: str, args) -> tuple[subprocess.Popen, str, Path]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = Path(tempfile.mkdtemp(prefix="soak-")) / "server.log"
    cmd = [sys.executable, "-c", "from mlx_engine.cli.main import main; main()", "serve", "--port", str(port),
           "--model", model, "--model", "shapes:64", "--max-sequences", str(args.max_sequences),
           "--context-length", "1024", "--read-timeout", "10"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log.open("w"),
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    url = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    while time.monotonic() - t0 < 600:
        if proc.poll() is not None:
            sys.exit(f"the server exited at start ({proc.returncode}); its log: {log}\n{log.read_text()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url, log
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    sys.exit("the server did not start within 10 minutes")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--model", default="smollm2:135m")
    ap.add_argument("--url", default=None, help="a running server (default: start one)")
    ap.add_argument("--pid", type=int, default=None, help="with --url: the server's process id, for its RSS")
    ap.add_argument("--max-requests", type=int, default=100_000, help="per client")
    ap.add_argument("--max-sequences", type=int, default=4, help="of a server this starts")
    ap.add_argument("--rss-mark", type=float, default=5.0,
                    help="minutes: RSS growth is measured from here (half the run when shorter)")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds, per request")
    args = ap.parse_args()

    proc = log = None
    if args.url:
        url, pid = args.url.rstrip("/"), args.pid
    else:
        proc, url, log = start_server(args.model, args)
        pid = proc.pid
    print(f"soak: {args.clients} clients for {args.minutes:g} min against {url} (model {args.model})", flush=True)
    rss_start = rss_bytes(pid)
    tally = Tally()
    t0 = time.monotonic()
    deadline = t0 + args.minutes * 60
    mark = min(args.rss_mark, args.minutes / 2)
    line_s = min(60.0, args.minutes * 6)  # a line a minute (ten lines in a short run), six samples a line
    monitor = Monitor(url, pid, tally, t0, every=line_s / 6, line_every=line_s)
    monitor.start()
    clients = [Client(i, url, args.model, deadline, args.max_requests, tally, args.timeout)
               for i in range(args.clients)]
    for c in clients:
        c.start()
    while any(c.is_alive() for c in clients):
        time.sleep(1.0)
        if time.monotonic() > deadline + args.timeout + 60:
            print("  clients still running past the deadline: reported as errors", flush=True)
            tally.add("run", "error", "a client did not finish within its request timeout after the deadline")
            break
    monitor.done.set()
    for _ in range(100):  # let cancelled requests drain
        end = server_status(url).get("models", {}).get(args.model, {})
        if not (end.get("decoding") or end.get("prefilling") or end.get("queued")):
            break
        time.sleep(0.1)
    time.sleep(3.0)  # the server gives freed memory back once idle for half a second
    idle = monitor.sample()
    end = server_status(url).get("models", {}).get(args.model, {})
    took = time.monotonic() - t0

    print(f"\n{'kind':16} {'requests':>9} {'ok':>7} {'4xx':>7} {'errors':>7}")
    total = Counter()
    for kind in sorted(tally.counts):
        c = tally.counts[kind]
        n = sum(c.values())
        total.update(c)
        print(f"{kind:16} {n:9d} {c['ok']:7d} {c['expected_4xx']:7d} {c['error']:7d}")
    print(f"{'all':16} {sum(total.values()):9d} {total['ok']:7d} {total['expected_4xx']:7d} {total['error']:7d}"
          f"   ({sum(total.values()) / took:.1f} requests/s over {took / 60:.1f} min)")
    for e in tally.errors:
        print("  error:", e)
    # RSS moves by the transient memory of whatever runs at the moment of a sample (an image being denoised, a long
    # prefill) and by the heap's pages not yet given back: a leak shows as a median that keeps rising.
    window = min(5.0, (args.minutes - mark) / 2)
    first, last = monitor.median_rss(mark, mark + window), monitor.median_rss(args.minutes - window, args.minutes)
    monitor.print_window(mark, mark + window, f"minutes {mark:g}-{mark + window:g}")
    monitor.print_window(args.minutes - window, args.minutes, f"minutes {args.minutes - window:g}-{args.minutes:g}")
    growth = (last / first - 1) * 100 if first and last else None
    print(f"RSS: start {fmt(rss_start)}; median over minutes {mark:g}-{mark + window:g} {fmt(first)}, over the last "
          f"{window:g} minutes {fmt(last)}: growth {'n/a' if growth is None else f'{growth:+.1f} %'}; idle at the "
          f"end {fmt(idle[1])} (MLX active {fmt(idle[2])}, MLX cache {fmt(idle[3])})")
    judged = args.minutes >= 2 * args.rss_mark  # a plateau needs as long again after the mark as before it
    memory_bad = judged and (growth is None or growth >= 5.0)
    if not judged:
        print(f"(RSS growth not judged: a run shorter than twice --rss-mark, {args.rss_mark:g} min)")
    left = {k: end.get(k) for k in ("decoding", "prefilling", "queued")}
    leaked = None
    if end:
        leaked = end.get("cells_in_use", 0) - end.get("cells_kept", 0)
        print(f"KV cells in use at the end: {end.get('cells_in_use')}; held by the conversations the prefix cache "
              f"keeps ({end.get('tokens_kept')} tokens in {end.get('slots')} slots): {end.get('cells_kept')}; "
              f"leaked: {leaked}; requests left: {left}")
    else:  # the last unload of the run let go of it
        print("KV cells at the end: the model is unloaded (its cache freed, no request left)")
    bad = total["error"] > 0 or any(left.values()) or memory_bad or bool(leaked)
    if proc is not None:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = "killed after 60 s"
        text = log.read_text(errors="replace")
        tracebacks, e500 = text.count("Traceback"), sum(" 500 " in ln for ln in text.splitlines())
        # uvicorn ends a server stopped by a signal by raising that signal again once it has shut down
        clean = code in (0, -signal.SIGTERM)
        print(f"server: exit {code}{' (SIGTERM, after a graceful shutdown)' if code == -signal.SIGTERM else ''}, "
              f"log {log}: {tracebacks} tracebacks, {e500} lines with status 500")
        bad = bad or not clean or tracebacks > 0 or e500 > 0
    return 1 if bad else 0


def fmt(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:.0f} MiB"


if __name__ == "__main__":
    sys.exit(main())
