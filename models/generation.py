"""What the teacher asks of the frozen target: batched generation and feature capture.

`generate` is a plain KV-cache decode loop rather than `model.generate`, for two reasons measured or required here:
rows that finish (EOS or length) leave the batch at once, so a long reply does not keep paying for the short ones;
and each row samples from its own seeded generator, so a sample's output does not depend on which other samples
share its batch (needed for a crash-resumed run to equal an uninterrupted one).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import DynamicCache


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


@torch.no_grad()
def generate(
    model,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    eos_ids: set[int],
    pad_id: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    generators: list[torch.Generator] | None = None,
    on_step: Callable[[int, list[int]], None] | None = None,
) -> list[list[int]]:
    """Continue each prompt until an EOS id (kept) or max_new_tokens. Left padding, one forward per step.

    on_step(new_tokens, finished_rows): called after every decode step with the number of tokens it produced and
    the prompt indices whose reply ended there (for progress reporting as rows finish).
    """
    device = model.device
    rows = len(prompts)
    width = max(len(p) for p in prompts)
    ids = torch.full((rows, width), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros((rows, width), dtype=torch.long, device=device)
    for r, p in enumerate(prompts):
        ids[r, width - len(p):] = torch.tensor(p, device=device)
        mask[r, width - len(p):] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache()
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache,
                use_cache=True, logits_to_keep=1)
    next_pos = mask.sum(-1)  # (rows,) position of the next token per row
    active = list(range(rows))  # original row index of each live batch row
    results: list[list[int]] = [[] for _ in range(rows)]
    eos = torch.tensor(sorted(eos_ids), device=device)
    for step in range(max_new_tokens):
        gens = [generators[r] for r in active] if generators else None
        tokens = _pick(out.logits[:, -1], temperature, top_p, gens)  # (live,)
        for r, t in zip(active, tokens.tolist()):
            results[r].append(t)
        keep = ~torch.isin(tokens, eos)
        last = step + 1 == max_new_tokens or not keep.any()
        if on_step:
            on_step(len(active), active if last else [r for r, k in zip(active, keep.tolist()) if not k])
        if last:
            break
        if not keep.all():
            idx = keep.nonzero().squeeze(-1)
            cache.batch_select_indices(idx)
            active = [active[i] for i in idx.tolist()]
            tokens, mask, next_pos = tokens[idx], mask[idx], next_pos[idx]
        mask = torch.cat([mask, mask.new_ones((len(active), 1))], dim=-1)
        out = model(input_ids=tokens[:, None], attention_mask=mask, position_ids=next_pos[:, None],
                    cache=cache, use_cache=True)
        next_pos = next_pos + 1
    return results


@torch.no_grad()
def capture(
    model,
    sequences: list[list[int]],
    layer_ids: list[int],
    *,
    pad_id: int,
    topk: int = 0,
    final: bool = False,
) -> list[dict[str, torch.Tensor]]:
    """One prefill over right-padded sequences: per sequence the tapped hidden states (T, n*H), concatenated in
    layer order (layer i = hidden_states[i + 1]), optionally the target's top-k log-probs of the distribution
    that predicted each token (row t from the logits at t-1; row 0 is zero), and with `final` its final (normed)
    hidden states `final_hidden` (T, H), the rows its LM head reads (the Weaver's verifier input)."""
    device = model.device
    rows, width = len(sequences), max(len(s) for s in sequences)
    ids = torch.full((rows, width), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros((rows, width), dtype=torch.long, device=device)
    for r, s in enumerate(sequences):
        ids[r, : len(s)] = torch.tensor(s, device=device)
        mask[r, : len(s)] = 1
    out = model.model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    taps = [out.hidden_states[i + 1] for i in layer_ids] or [out.last_hidden_state[..., :0]]  # no taps: width 0
    feats = torch.cat(taps, dim=-1)  # (rows, width, n*H)
    results = []
    for r, s in enumerate(sequences):
        n = len(s)
        item = {"features": feats[r, :n]}
        if final:
            item["final_hidden"] = out.last_hidden_state[r, :n]
        if topk:
            logp = torch.log_softmax(model.lm_head(out.last_hidden_state[r, : n - 1]).float(), dim=-1)  # (n-1, V)
            vals, idx = logp.topk(topk, dim=-1)
            item["topk_logprobs"] = torch.cat([vals.new_zeros(1, topk), vals])
            item["topk_ids"] = torch.cat([idx.new_zeros(1, topk), idx])
        results.append(item)
    return results


def recapture(model, items: list[dict], layer_ids: list[int], *, pad_id: int, final: bool = False) -> list[dict]:
    """Replace the stored features of teacher-style items (input_ids (T,)) with features captured now, on the CPU:
    for training with the target in the loop, or for a drafter that taps other layers than the stored ones. With
    `final`, also store the target's final hidden states (`final_hidden`, what the Weaver reads)."""
    outs = capture(model, [it["input_ids"].tolist() for it in items], layer_ids, pad_id=pad_id, final=final)
    for it, o in zip(items, outs):
        it["features"] = o["features"].cpu()
        if final:
            it["final_hidden"] = o["final_hidden"].float().cpu()
    return items
