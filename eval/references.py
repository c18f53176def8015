"""What the evaluation compares against: the target's own greedy replies, generated once and reused, and the
prompts of every turn of a multi-turn eval set, conditioned on those replies.

Autoregressive references are cached beside the target cache (<cache_dir>/references/), one file per
(target, weights, dtype, prompt, max_new_tokens), named by the hash of that key. Every method, eval run and sweep job
that asks for the same reply reads it instead of decoding it again. A file is trusted only if the key stored inside
it equals the key asked for (a stale, renamed or corrupt file is refused with a warning and regenerated); files are
written under a temporary name and renamed when complete.

References are generated with the teacher's continuously batched greedy decoding (models/generation.py). They are
the tokens the teacher-forced metrics run on and the first replies that later turns are conditioned on; the
exactness check of the online loop compares each speculative run with an autoregressive run made right beside it,
under the same thread settings, not with the cache.
"""
from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

from dflash_pipeline.runtime.progress import Progress
from dflash_pipeline.runtime.files import write_json
from dflash_pipeline.models.generation import generate
from dflash_pipeline.models.families import final_norm
from dflash_pipeline.models.target import Target

log = logging.getLogger(__name__)


def target_fingerprint(target: Target) -> str:
    """A short hash of what decides the target's replies besides the prompt: its reference, dtype, and a sample of
    its weights (so a changed checkpoint behind the same name is not mistaken for the old one)."""
    model = target.model
    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    h = hashlib.sha256(f"{target.ref}|{emb.dtype}|{tuple(emb.shape)}".encode())
    for w in (emb, head, *(p for p in final_norm(model).parameters())):
        h.update(w.detach().flatten()[:4096].float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


class ReferenceCache:
    """Greedy autoregressive replies of one target, cached on disk by key hash."""

    def __init__(self, folder: str | Path, target: Target, batch_size: int = 16, prefill_tokens: int = 4096):
        self.target, self.batch_size, self.prefill_tokens = target, batch_size, prefill_tokens
        self.fingerprint = target_fingerprint(target)
        self.folder = Path(folder) / self.fingerprint
        self.generated = self.reused = 0

    def key(self, prompt_ids: list[int], max_new_tokens: int) -> dict:
        return {"target": self.target.ref, "fingerprint": self.fingerprint, "dtype": self.target.dtype,
                "prompt_sha256": hashlib.sha256(json.dumps(prompt_ids).encode()).hexdigest(),
                "prompt_tokens": len(prompt_ids), "max_new_tokens": max_new_tokens}

    def path(self, key: dict) -> Path:
        return self.folder / (hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32] + ".json")

    def load(self, prompt_ids: list[int], max_new_tokens: int) -> list[int] | None:
        """The cached reply, or None when there is none or the file's stored key is not this key (refused)."""
        key = self.key(prompt_ids, max_new_tokens)
        f = self.path(key)
        if not f.is_file():
            return None
        try:
            stored = json.loads(f.read_text())
            ok = stored.get("key") == key and all(isinstance(t, int) for t in stored["tokens"])
        except (OSError, ValueError, KeyError, TypeError):
            ok = False
        if not ok:
            log.warning("AR reference %s does not hold the reply it is named for (other key or corrupt): "
                        "refused, regenerating it", f)
            return None
        return stored["tokens"]

    def replies(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        """The target's greedy reply to every prompt: from the cache where present, the rest generated in one
        continuously batched decode and stored."""
        out = [self.load(p, max_new_tokens) for p in prompts]
        missing = [i for i, r in enumerate(out) if r is None]
        self.reused += len(prompts) - len(missing)
        if missing:
            t = self.target
            order = sorted(missing, key=lambda i: len(prompts[i]))
            with Progress("AR references", len(missing), "prompt") as bar:
                def on_step(new_tokens: int, finished: list[int]) -> None:
                    bar.add("tok", new_tokens)
                    bar.update(len(finished))

                new = generate(t.model, [prompts[i] for i in order], max_new_tokens=max_new_tokens,
                               eos_ids=t.eos_ids, pad_id=t.tokenizer.pad_token_id, batch_size=self.batch_size,
                               prefill_tokens=self.prefill_tokens, on_step=on_step)
            self.folder.mkdir(parents=True, exist_ok=True)
            for i, reply in zip(order, new):
                key = self.key(prompts[i], max_new_tokens)
                write_json(self.path(key), {"key": key, "tokens": reply})
                out[i] = reply
            self.generated += len(missing)
        return out


def turn_prompts(tokenizer, conversations: list[dict], turns: int, references: ReferenceCache,
                 max_new_tokens: int, room: int) -> list[list[dict]]:
    """Prompts of turns 1..`turns` of each conversation: turn k's prompt is turn k-1's prompt + the target's own
    greedy reply to it (token ids as generated, never re-tokenized text) + the template's tokens up to the next
    assistant turn. Returns one list per turn of {"id", "prompt_ids"}; a conversation drops out of later turns when it
    has no such turn or its prompt would not leave `room` for a reply."""
    from dflash_pipeline.data.teacher import chat_segments

    segments = {c["id"]: chat_segments(tokenizer, c["messages"], turns) for c in conversations}
    current = [{"id": c["id"], "prompt_ids": segments[c["id"]][0]} for c in conversations]
    current = [p for p in current if len(p["prompt_ids"]) <= room]
    out = [current]
    eos = references.target.eos_ids
    for k in range(1, turns):
        later = [p for p in current if len(segments[p["id"]]) > k]
        replies = references.replies([p["prompt_ids"] for p in later], max_new_tokens)
        nxt = []
        for p, reply in zip(later, replies):
            seg = segments[p["id"]][k]
            if reply and reply[-1] in eos and seg[:1] == reply[-1:]:
                seg = seg[1:]  # the reply already ended with the template's end-of-turn token
            ids = p["prompt_ids"] + reply + seg
            if len(ids) <= room:
                nxt.append({"id": p["id"], "prompt_ids": ids, "turn": k + 1,
                            "reply_span": [len(p["prompt_ids"]), len(p["prompt_ids"]) + len(reply)]})
        if not nxt:
            break
        out.append(nxt)
        current = nxt
    return out
