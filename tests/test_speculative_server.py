"""A draft model in the server (issue 62): ``serve --draft-model``, its sequences drafting together in the continuous
batch, each with its own draft cache and its own draft length.

Oracle: the target's plain greedy answers (no speculation), through the real ``openai`` client, and through the
single-request runner for the scheduler. A model drafting for itself must have every draft accepted (the same
weights, the same argmax); a random draft model of the same vocabulary must change nothing but the acceptance."""

from __future__ import annotations

import concurrent.futures
import json
import shutil

import pytest

import mlx_engine
from mlx_engine.errors import InvalidRequestError
from mlx_engine.models.generation.speculative import DraftLength
from mlx_engine.server import ServerConfig
from mlx_engine.server.scheduler import TextScheduler
from tests.test_server import RunningServer, free_port
from tests.test_server_scheduler import alone, run_until, submit
from tests.test_speculative import PARAGRAPH
from tests.test_speculative_draft import PROMPTS, random_draft  # noqa: F401 -- a fixture


#: four prompts whose first 24 tokens of answer differ (PROMPTS[2] starts as PROMPTS[0] does)
SERVED = [PROMPTS[0], PROMPTS[1], PROMPTS[3], "Who wrote Hamlet?"]


def _server(home, **config) -> RunningServer:
    return RunningServer(ServerConfig(port=free_port(), max_sequences=4, context_length=1024, store_root=str(home),
                                      **config))


def test_the_served_model_drafting_for_itself_gives_the_plain_answers(home_with_smollm2):
    """``serve --model smollm2:135m --draft-model smollm2:135m``: four requests at once with ``speculative:
    "off"``, then four at once, two without the field (the default: the draft model) and two with ``"draft"``,
    give the same answers; every draft token is accepted; /status shows the draft model, the acceptance rate and
    the tokens per verification."""
    from openai import OpenAI

    srv = _server(home_with_smollm2, models=["smollm2:135m"], draft_models=["smollm2:135m"])
    try:
        client = OpenAI(base_url=srv.url + "/v1", api_key="none")

        def ask(prompt, **extra):
            r = client.chat.completions.create(model="smollm2:135m", messages=[{"role": "user", "content": prompt}],
                                               temperature=0, max_tokens=24, extra_body=extra or None)
            return r.choices[0].message.content

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            plain = list(pool.map(lambda p: ask(p, speculative="off"), SERVED))
            fast = list(pool.map(lambda i: ask(SERVED[i], **({"speculative": "draft", "draft_tokens": 4} if i % 2
                                                              else {})), range(4)))
        assert fast == plain and len(set(plain)) == 4
        status = next(v for k, v in srv.status()["models"].items() if k.startswith("smollm2"))
        assert status["draft_model"] == "smollm2:135m"
        assert status["draft_proposed"] > 40 and status["draft_accepted"] == status["draft_proposed"]
        assert status["acceptance_rate"] == 1.0
        assert status["tokens_per_verification"] == pytest.approx(
            (status["draft_accepted"] + status["verify_steps"]) / status["verify_steps"])
        assert status["tokens_per_verification"] > 3
    finally:
        srv.stop()


def test_a_random_draft_model_in_the_batch_changes_only_the_acceptance(smollm2_gguf, random_draft,  # noqa: F811
                                                                        monkeypatch):
    """Four requests batched by the scheduler: two draft with a random model of smollm2's vocabulary (one of them
    past a prompt longer than the prefill chunk, which reaches the draft model one chunk per step), one with prompt
    lookup, one plainly. Each answer is the one it gives alone without speculation; each drafting sequence has its
    own sequence of the draft cache, and its own draft length: the rule of ``DraftLength`` replayed on that
    sequence's own passes alone gives its lengths, and the sequences' lengths differ."""
    history: dict[int, list[tuple[int, int, int]]] = {}  # per DraftLength: (proposed, accepted, k after)
    update = DraftLength.update

    def recorded(self, proposed, accepted):
        update(self, proposed, accepted)
        history.setdefault(id(self), []).append((proposed, accepted, self.k))

    monkeypatch.setattr(DraftLength, "update", recorded)
    m = mlx_engine.Model("smollm2:135m", smollm2_gguf, context_length=1024, max_sequences=4, prefill_chunk=64)
    m.attach_draft(mlx_engine.Model("random", random_draft, context_length=1024, max_sequences=4, prefill_chunk=64))
    try:
        prompts = [m.chat_tokens([{"role": "user", "content": p}]) for p in PROMPTS]
        assert len(prompts[0]) > 64  # the draft model takes it in two chunks, on two steps
        want = [alone(m, p, 24, speculative="off") for p in prompts]
        sched = TextScheduler(m.runner)  # the server's default: the draft model
        jobs = [submit(sched, prompts[0], 24), submit(sched, prompts[1], 24),
                submit(sched, prompts[2], 24, speculative="lookup"), submit(sched, prompts[3], 24, speculative="off")]
        run_until(sched, lambda: all(c.done for _, c in jobs))
        assert [c.error for _, c in jobs] == [None] * 4
        assert [c.answer for _, c in jobs] == want
        for job, c in jobs[:2]:
            assert c.stats.draft_proposed > 0 and c.stats.draft_accepted < c.stats.draft_proposed / 2
            assert m.runner.draft.cached_length(job.seq) >= len(job.tokens)  # its own draft cache
        assert m.runner.draft.cached_length(jobs[3][0].seq) == 0  # no speculation: nothing on the draft model
        assert jobs[2][1].stats.draft_accepted > 5
        lengths = []
        for job, _ in jobs[:3]:
            replay = DraftLength(job.length.most)
            ks = []
            for proposed, accepted, _ in history[id(job.length)]:
                update(replay, proposed, accepted)
                ks.append(replay.k)
            assert ks == [k for _, _, k in history[id(job.length)]]
            lengths.append(ks)
        assert 1 in lengths[0] and 1 in lengths[1] and lengths[2] != lengths[0]
        # the long prompt reached the draft model over two steps: no draft on the first
        assert history[id(jobs[0][0].length)][0][0] == 0
        load = sched.load()
        assert load["acceptance_rate"] == load["draft_accepted"] / load["draft_proposed"]
    finally:
        m.close()


def test_a_draft_model_of_another_vocabulary_is_a_clear_error(home_with_smollm2, random_draft, tmp_path):  # noqa: F811
    """``--draft-model smollm2:135m=OTHER`` where OTHER's tokenizer has two ids swapped: the first request for
    smollm2:135m (which loads it) is a 400 naming the first id that differs."""
    import openai

    other = tmp_path / "other"
    shutil.copytree(random_draft, other)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]
    (other / "tokenizer.json").write_text(json.dumps(tok))
    srv = _server(home_with_smollm2, draft_models=[f"smollm2:135m={other}"])
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.BadRequestError, match=r"has another vocabulary than smollm2:135m .*id \d+ is"):
            client.chat.completions.create(model="smollm2:135m", messages=[{"role": "user", "content": "Hi"}],
                                           max_tokens=4)
        assert srv.status()["models"] == {}
    finally:
        srv.stop()


def test_draft_model_options_are_checked():
    with pytest.raises(InvalidRequestError, match="which model does it draft for"):
        ServerConfig(draft_models=["smollm2:135m"]).check()
    with pytest.raises(InvalidRequestError, match="give DRAFT or TARGET=DRAFT"):
        ServerConfig(draft_models=["smollm2:135m="]).check()
    assert ServerConfig(models=["a", "b"], draft_models=["d", "c=e"]).draft_pairs() == [("a", "d"), ("b", "d"),
                                                                                         ("c", "e")]

