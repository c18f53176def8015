"""What the teacher asks of the frozen target: batched generation and feature capture.

`generate` is a plain KV-cache decode loop with continuous batching rather than `model.generate`, for reasons
measured or required here: rows that finish (EOS or length) leave the batch at once and queued prompts take their
place, so the batch stays full and a long reply does not keep paying for the short ones (scripts/bench_teacher.py);
and each row samples from its own seeded generator, so a sample's output does not depend on which other samples
share its batch (needed for a crash-resumed run to equal an uninterrupted one).
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from dflash_pipeline.models import cache as target_cache
from dflash_pipeline.models.families import final_norm, output_logits, tapped


def _pick(logits: torch.Tensor, temperature: float, top_p: float, generators: list[torch.Generator] | None):
    """Next token per row: argmax when temperature == 0, else nucleus sampling with each row's generator."""
    if temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)  # (B, V)
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        drop = sorted_p.cumsum(-1) - sorted_p > top_p  # keep the smallest prefix whose mass reaches top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    return torch.cat([torch.multinomial(p, 1, generator=g) for p, g in zip(probs, generators)])


def _left_pad(prompts: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, mask) of left-padded prompts: every row's next token goes in the same column."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros((len(prompts), width), dtype=torch.long, device=device)
    for r, p in enumerate(prompts):
        ids[r, width - len(p):] = torch.tensor(p, device=device)
        mask[r, width - len(p):] = 1
    return ids, mask


class ContinuousBatch:
    """The state of continuous batching over `prompts`: a queue of prompts not yet admitted and the decode rows
    (the prompt index of each, their KV cache and attention mask, the token each feeds next and its position).
    `run()` admits and decodes until every reply has ended; see `generate` for the policy."""

    def __init__(self, model, prompts: list[list[int]], *, max_new_tokens: int, eos_ids: set[int], pad_id: int,
                 temperature: float = 0.0, top_p: float = 1.0, generators: list[torch.Generator] | None = None,
                 on_step: Callable[[int, list[int]], None] | None = None, batch_size: int | None = None,
                 prefill_tokens: int | None = None, taps: list[int] | None = None, max_len: int | None = None):
        self.model, self.prompts, self.max_new_tokens, self.pad_id = model, prompts, max_new_tokens, pad_id
        self.max_len = max_len or 1 << 62  # prompt + reply: a reply ends at the target's context
        self.eos = set(eos_ids)
        self.temperature, self.top_p, self.generators, self.on_step = temperature, top_p, generators, on_step
        self.batch_size = batch_size or len(prompts)
        self.refill_at = max(1, self.batch_size // 4)  # free rows that trigger an admission
        self.prefill_tokens = prefill_tokens or 1 << 62
        # A recurrent target's prompts are prefilled one by one: left padding would run through its recurrent layers
        # (their state is per row and exact only without padding); decode steps are still batched.
        self.prefill_alone = target_cache.is_recurrent(model)
        self.taps = taps
        self.hidden = {"output_hidden_states": True} if taps is not None else {}
        self.queue = list(range(len(prompts)))[::-1]  # popped from the end: prompt order
        self.replies: list[list[int]] = [[] for _ in prompts]
        self.seen: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in prompts]  # (taps, final) chunks
        self.cache = self.mask = self.tokens = self.next_pos = None  # per decode row: next token, its position
        self.active: list[int] = []  # the prompt index of each decode row
        self.closing: list[bool] = []  # rows whose reply has ended, kept one step so taps see their last token

    def free(self) -> int:
        return self.batch_size - len(self.active)

    def run(self) -> None:
        while self.queue or self.active:
            if self.queue and (not self.active or self.free() >= self.refill_at):
                self.admit()
                if self.queue and self.free() >= self.refill_at:
                    continue  # the prefill budget stopped the admission: admit more before decoding
            if self.active:
                self.step()

    def captured(self) -> list[dict[str, torch.Tensor]]:
        return [{"features": torch.cat([f for f, _ in chunks]), "final_hidden": torch.cat([h for _, h in chunks])}
                for chunks in self.seen]

    def record(self, out, rows: list[int], spans: list[slice]) -> None:
        # The taps of the whole batch, once per pass: a row keeps a view of them until captured(), and a view keeps
        # its whole tensor, so one made per row held the batch's taps once per row (6.0 GB vs 3.2 in the main job).
        hs, feats = out.hidden_states, tapped(out.hidden_states, self.taps)
        for j, (r, span) in enumerate(zip(rows, spans)):
            self.seen[r].append((feats[j, span], hs[-1][j, span]))

    def pick(self, logits: torch.Tensor, rows: list[int], live: list[bool]) -> tuple[torch.Tensor, list[bool]]:
        """The next token of each live row, appended to its reply; whether each row goes on decoding."""
        gens = [self.generators[r] for r in rows] if self.generators else None
        picked = _pick(logits, self.temperature, self.top_p, gens)
        goes_on = []
        for r, t, lv in zip(rows, picked.tolist(), live):
            if lv:
                self.replies[r].append(t)
            goes_on.append(lv and t not in self.eos and len(self.replies[r]) < self.max_new_tokens
                           and len(self.prompts[r]) + len(self.replies[r]) < self.max_len)
        if self.on_step:
            self.on_step(sum(live), [r for r, g, lv in zip(rows, goes_on, live) if lv and not g])
        return picked, goes_on

    def admit(self) -> None:
        """Prefill the next queued prompts together (as many as fit the free rows and the prefill budget, one at
        least) and merge the rows that go on into the running batch."""
        device, prompts = self.model.device, self.prompts
        new = [self.queue.pop()]
        while self.queue and not self.prefill_alone and len(new) < self.free() \
                and (len(new) + 1) * len(prompts[self.queue[-1]]) \
                <= self.prefill_tokens:
            new.append(self.queue.pop())
        ids, new_mask = _left_pad([prompts[r] for r in new], self.pad_id, device)
        new_cache = target_cache.new_cache(self.model)
        out = self.model(input_ids=ids, attention_mask=new_mask, position_ids=(new_mask.cumsum(-1) - 1).clamp(min=0),
                         cache=new_cache, use_cache=True, logits_to_keep=1, **self.hidden)
        if self.hidden:
            self.record(out, new, [slice(ids.shape[1] - len(prompts[r]), None) for r in new])
        picked, goes_on = self.pick(out.logits[:, -1], new, [True] * len(new))
        keep = [i for i, g in enumerate(goes_on) if g or self.hidden]  # with taps, a finished row stays one step
        if not keep:
            return
        idx = torch.tensor(keep, device=device)
        if len(keep) < len(new):
            target_cache.select_rows(new_cache, idx)
        new_mask, new_pos = new_mask[idx], new_mask[idx].sum(-1)
        if self.cache is None:
            self.cache, self.mask, self.tokens, self.next_pos = new_cache, new_mask, picked[idx], new_pos
        else:
            self.mask = target_cache.merge_rows(self.cache, self.mask, new_cache, new_mask)
            self.tokens, self.next_pos = torch.cat([self.tokens, picked[idx]]), torch.cat([self.next_pos, new_pos])
        self.active += [new[i] for i in keep]
        self.closing += [not goes_on[i] for i in keep]

    def step(self) -> None:
        """One decode step of every row; rows whose reply ended leave the batch (with taps, one step later)."""
        rows = self.active
        self.mask = torch.cat([self.mask, self.mask.new_ones((len(rows), 1))], dim=-1)
        out = self.model(input_ids=self.tokens[:, None], attention_mask=self.mask, position_ids=self.next_pos[:, None],
                         cache=self.cache, use_cache=True, **self.hidden)
        if self.hidden:
            self.record(out, rows, [slice(None)] * len(rows))
        picked, goes_on = self.pick(out.logits[:, -1], rows, [not c for c in self.closing])
        next_pos = self.next_pos + 1
        keep = [i for i, (g, c) in enumerate(zip(goes_on, self.closing)) if g or (self.hidden and not c)]
        self.closing = [not goes_on[i] for i in keep]
        if len(keep) < len(rows):
            self.active = [rows[i] for i in keep]
            if not self.active:
                self.cache = self.mask = self.tokens = self.next_pos = None
                return
            idx = torch.tensor(keep, device=self.model.device)
            target_cache.select_rows(self.cache, idx)
            self.mask = target_cache.trim_padding(self.cache, self.mask[idx])
            picked, next_pos = picked[idx], next_pos[idx]
        self.tokens, self.next_pos = picked, next_pos


@torch.no_grad()
def generate(model, prompts: list[list[int]], **settings) -> list[list[int]]:
    """Continue each prompt until an EOS id (kept) or max_new_tokens, decoding up to `batch_size` rows together;
    returns the replies.

    Settings (ContinuousBatch): max_new_tokens, eos_ids, pad_id, temperature / top_p / generators (one per prompt),
    on_step, batch_size, prefill_tokens.

    Continuous batching: prompts are admitted from a queue in the given order (sort them by length for little
    padding); a row leaves the decode batch the step its reply ends, and once a quarter of the rows are free the
    next prompts are prefilled together (at most `prefill_tokens` = rows x longest prompt, one row always fits)
    and merged into the running batch. So the ragged tail of a batch no longer decodes a few rows at a time, and
    a sample's reply does not depend on which others share its batch (its own generator; left padding with
    explicit positions). batch_size None: all prompts in one batch.

    on_step(new_tokens, finished_rows): called after every decode step (and admission) with the number of tokens
    it produced and the prompt indices whose reply ended there (for progress reporting as rows finish).
    """
    batch = ContinuousBatch(model, prompts, **settings)
    batch.run()
    return batch.replies


@torch.no_grad()
def generate_capturing(model, prompts: list[list[int]], taps: list[int], **settings
                       ) -> tuple[list[list[int]], list[dict[str, torch.Tensor]]]:
    """`generate`, also capturing, as the tokens go through the target, the tapped layers' hidden states (layer
    i = hidden_states[i + 1]) and the final normed hidden states of every token of prompt + reply (a finished row
    stays for one more step so its last token is seen too): (replies, [{"features" (T, n*H), "final_hidden"
    (T, H)}])."""
    batch = ContinuousBatch(model, prompts, taps=taps, **settings)
    batch.run()
    return batch.replies, batch.captured()


@torch.no_grad()
def topk_logprobs(model, final_hidden: torch.Tensor, k: int, chunk: int = 256) -> dict[str, torch.Tensor]:
    """The target's top-k log-probs and ids of the distribution that predicted each token of a sequence, from its
    final hidden states (T, H): row t from the logits at t-1, row 0 zero. The top-k of the logits minus their
    logsumexp, in chunks of rows, so no (T, V) log-softmax is materialised."""
    rows = final_hidden[:-1]
    vals, ids = [], []
    for i in range(0, len(rows), chunk):
        logits = output_logits(model, rows[i: i + chunk]).float()
        v, j = logits.topk(k, dim=-1)
        vals.append(v - torch.logsumexp(logits, dim=-1, keepdim=True))
        ids.append(j)
    zeros = torch.zeros(1, k, device=final_hidden.device)
    return {"topk_logprobs": torch.cat([zeros, *vals]), "topk_ids": torch.cat([zeros.long(), *ids])}


@torch.no_grad()
def capture(
    model,
    sequences: list[list[int]],
    layer_ids: list[int],
    *,
    pad_id: int,
    topk: int = 0,
    final: bool = False,
    prenorm_final: bool = False,
) -> list[dict[str, torch.Tensor]]:
    """One prefill over right-padded sequences: per sequence the tapped hidden states (T, n*H), concatenated in
    layer order (layer i = hidden_states[i + 1]), optionally the target's top-k log-probs of the distribution
    that predicted each token (row t from the logits at t-1; row 0 is zero), with `final` its final (normed)
    hidden states `final_hidden` (T, H), the rows its LM head reads (the Weaver's verifier input), and with
    `prenorm_final` its last layer's output before the final norm, `prenorm_final_hidden` (T, H) (transformers'
    last hidden_states entry is after the norm; speculators recomputes its labels from the one before)."""
    device = model.device
    rows, width = len(sequences), max(len(s) for s in sequences)
    ids = torch.full((rows, width), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros((rows, width), dtype=torch.long, device=device)
    for r, s in enumerate(sequences):
        ids[r, : len(s)] = torch.tensor(s, device=device)
        mask[r, : len(s)] = 1
    seen: list[torch.Tensor] = []
    hook = final_norm(model).register_forward_pre_hook(lambda _m, args: seen.append(args[0])) if prenorm_final else None
    try:
        out = model.model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    finally:
        if hook is not None:
            hook.remove()
    feats = tapped(out.hidden_states, layer_ids)  # (rows, width, n*H)
    results = []
    for r, s in enumerate(sequences):
        n = len(s)
        item = {"features": feats[r, :n]}
        if final:
            item["final_hidden"] = out.last_hidden_state[r, :n]
        if prenorm_final:
            item["prenorm_final_hidden"] = seen[-1][r, :n]
        if topk:
            item.update(topk_logprobs(model, out.last_hidden_state[r, :n], topk))
        results.append(item)
    return results


def budget_batches(sequences: list, max_rows: int, max_tokens: int) -> list[list]:
    """Consecutive batches of length-sorted sequences with at most max_rows rows and rows x longest <= max_tokens
    (one row always fits): long prompts go in small batches, so padding never dominates a prefill."""
    batches: list[list] = []
    for s in sequences:
        if batches and len(batches[-1]) < max_rows and (len(batches[-1]) + 1) * len(s) <= max_tokens:
            batches[-1].append(s)
        else:
            batches.append([s])
    return batches


def capture_batched(model, sequences: list[list[int]], layer_ids: list[int], *, pad_id: int, max_tokens: int = 8192,
                    topk: int = 0, final: bool = False, prenorm_final: bool = False,
                    done_callback=None) -> list[dict[str, torch.Tensor]]:
    """capture() in length-sorted batches of at most `max_tokens` (rows x longest), so one long sequence does not
    pad every row of a single batch to its length; results in the order of `sequences`. done_callback(n) after
    each batch of n sequences (progress: a long sequence's prefill takes a CPU minutes)."""
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    results: list[dict] = [{}] * len(sequences)
    done = 0
    for batch in budget_batches([sequences[i] for i in order], len(order), max_tokens):
        for out in capture(model, batch, layer_ids, pad_id=pad_id, topk=topk, final=final, prenorm_final=prenorm_final):
            results[order[done]] = out
            done += 1
        if done_callback is not None:
            done_callback(len(batch))
    return results


class CapturedFeatures(torch.utils.data.Dataset):
    """A tokens-only teacher dataset (teacher.feature_dtype=none) read with its features captured from the target
    now, one sequence per read: what a stage on a frozen drafter reads such a dataset through."""

    def __init__(self, data, model, pad_id: int):
        self.data, self.model, self.pad_id = data, model, pad_id

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict:
        return recapture(self.model, [self.data[i]], self.data.layer_ids, pad_id=self.pad_id)[0]

    def __getattr__(self, name: str):  # ids, manifest, layer_ids, ...: the dataset's own
        if name == "data":
            raise AttributeError(name)
        return getattr(self.data, name)


def recapture(model, items: list[dict], layer_ids: list[int], *, pad_id: int, final: bool = False,
              max_tokens: int = 8192) -> list[dict]:
    """Replace the stored features of teacher-style items (input_ids (T,)) with features captured now, on the CPU:
    for training with the target in the loop, or for a drafter that taps other layers than the stored ones. With
    `final`, also store the target's final hidden states (`final_hidden`, what the Weaver reads)."""
    outs = capture_batched(model, [it["input_ids"].tolist() for it in items], layer_ids, pad_id=pad_id,
                           max_tokens=max_tokens, final=final)
    for it, o in zip(items, outs):
        it["features"] = o["features"].cpu()
        if final:
            it["final_hidden"] = o["final_hidden"].float().cpu()
    return items
