"""What the evaluation compares against: cached autoregressive references and prompts of later turns."""
from __future__ import annotations

import json

import pytest
import torch

from dflash_pipeline.data.sources import load_conversations
from dflash_pipeline.data.teacher import chat_segments
from dflash_pipeline.eval.decode import autoregressive
from dflash_pipeline.eval.references import ReferenceCache, turn_prompts
from tests.conftest import chat_prompt_ids


@pytest.fixture(scope="module")
def prompts(target):
    return chat_prompt_ids(target.tokenizer, ["Write a haiku about the sea.", "What is 12 times 7?"])


def test_cached_reference_is_reused_and_refused_when_its_key_differs(target, prompts, tmp_path):
    greedy = [autoregressive(target, p, 12)[0] for p in prompts]
    first = ReferenceCache(tmp_path, target)
    assert first.replies(prompts, 12) == greedy and (first.generated, first.reused) == (2, 0)

    again = ReferenceCache(tmp_path, target)  # another run, method or sweep job
    assert again.replies(prompts, 12) == greedy and (again.generated, again.reused) == (0, 2)
    other_length = ReferenceCache(tmp_path, target)
    other_length.replies(prompts[:1], 8)
    assert (other_length.generated, other_length.reused) == (1, 0), "max_new_tokens is part of the key"

    # A file that holds another prompt's reply under this prompt's name is refused and regenerated.
    a, b = (again.path(again.key(p, 12)) for p in prompts)
    stored = json.loads(a.read_text())
    stored["tokens"] = [7, 7, 7]
    b.write_text(json.dumps(stored))
    assert again.load(prompts[1], 12) is None
    fresh = ReferenceCache(tmp_path, target)
    assert fresh.replies(prompts, 12) == greedy and (fresh.generated, fresh.reused) == (1, 1)
    # So is a truncated file.
    a.write_text(a.read_text()[:20])
    assert fresh.load(prompts[0], 12) is None


def test_other_weights_get_other_references(target, prompts, tmp_path):
    cache = ReferenceCache(tmp_path, target)
    before = cache.key(prompts[0], 12)
    norm = target.model.model.norm.weight
    saved = norm.detach().clone()
    try:
        with torch.no_grad():
            norm.mul_(1.5)
        assert ReferenceCache(tmp_path, target).key(prompts[0], 12) != before
    finally:
        with torch.no_grad():
            norm.copy_(saved)


def test_second_turn_prompts_contain_the_targets_own_first_reply(target, tmp_path):
    tok = target.tokenizer
    convs = load_conversations("mtbench", split="all", limit=3, log=lambda s: None)
    cache = ReferenceCache(tmp_path, target)
    first, second = turn_prompts(tok, convs, 2, cache, max_new_tokens=10, room=10_000)
    assert [p["id"] for p in second] == [c["id"] for c in convs]
    for c, p1, p2 in zip(convs, first, second):
        segments = chat_segments(tok, c["messages"], 2)
        assert p1["prompt_ids"] == segments[0]
        reply = autoregressive(target, p1["prompt_ids"], 10)[0]  # the target's own first answer, as generated
        start, end = p2["reply_span"]
        assert p2["prompt_ids"][:start] == p1["prompt_ids"]
        assert p2["prompt_ids"][start:end] == reply, "the reply's ids as generated, not re-tokenised text"
        rest = p2["prompt_ids"][end:]
        assert rest == segments[1][len(segments[1]) - len(rest):], "then only the template up to turn 2"
        second_user = [m["content"] for m in c["messages"] if m["role"] == "user"][1]
        assert second_user.strip()[:20] in tok.decode(rest)


def test_later_turns_that_do_not_fit_are_dropped(target, tmp_path):
    convs = load_conversations("mtbench", split="all", limit=2, log=lambda s: None)
    cache = ReferenceCache(tmp_path, target)
    first = turn_prompts(target.tokenizer, convs, 1, cache, max_new_tokens=10, room=10_000)
    assert len(first) == 1 and cache.generated == 0, "one turn needs no reply"
    room = max(len(p["prompt_ids"]) for p in first[0]) + 5
    turns = turn_prompts(target.tokenizer, convs, 2, cache, max_new_tokens=10, room=room)
    assert len(turns) == 1, "second turns longer than the room are dropped"
