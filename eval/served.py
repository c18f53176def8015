"""Served acceptance: the exported drafter in vLLM on the eval's prompts, beside the project's own exact loop, and
the parity gate between the two (docs/metrics.md, 'Served acceptance').

A drafter whose training acceptance does not survive serving nearly always differs in a contract detail between
trainer and engine (a tap off by one, the mask token, RoPE, the causal flag, the draft vocabulary map), not in
quality. Both engines verify greedily, so on the same prompts in float32 they must run the same rounds: vLLM's
counters (drafts, accepted tokens per draft position) must equal the own loop's counts exactly, and vLLM's
speculative outputs must equal its plain decoding and the project's autoregressive references. In reduced precision
kernels round differently: outputs may part at near-ties (classified as the own eval does) and the per-position
acceptance must agree within eval.served.tolerance. A failed gate says so in one line naming the likely contract key.
"""
from __future__ import annotations

import hashlib
import json
import logging
import statistics
from pathlib import Path

import torch
from safetensors import safe_open

from dflash_pipeline.conf.progress import Progress
from dflash_pipeline.eval.exactness import IDENTICAL, NEAR_TIE, ExactnessJudge
from dflash_pipeline.models.vllm_engine import VLLMEngine, speculative_config

log = logging.getLogger(__name__)

# What the engine reads from an export, as dotted config.json keys; "d2t" is the draft-vocabulary map tensor.
CONTRACT = ("dflash_config.target_layer_ids", "dflash_config.mask_token_id", "rope_theta", "rope_scaling",
            "num_hidden_layers", "hidden_size", "head_dim", "num_attention_heads", "num_key_value_heads",
            "draft_vocab_size", "d2t", "max_position_embeddings")
# Keys the engine honours and the own loop does not run (its drafter is non-causal full attention): any value that
# makes the engine's drafter causal or windowed is a mismatch by itself (a window size alone windows nothing).
ENGINE_ONLY = ("is_causal", "dflash_config.causal", "layer_types", "use_swa", "dflash_config.use_swa")
WHAT = {
    "dflash_config.target_layer_ids": "the tapped target layers (layer i = hidden_states[i + 1])",
    "dflash_config.mask_token_id": "the MASK token of the drafted slots",
    "rope_theta": "RoPE base", "rope_scaling": "RoPE scaling",
    "d2t": "the draft-vocabulary map (target id = draft id + d2t[draft id])",
    "draft_vocab_size": "the draft vocabulary size",
    "is_causal": "the causal flag (DFlash drafts attend bidirectionally)",
    "dflash_config.causal": "the causal flag (DFlash drafts attend bidirectionally)",
    "layer_types": "sliding-window layers", "use_swa": "sliding-window attention",
    "dflash_config.use_swa": "sliding-window attention",
}


# -- counts ------------------------------------------------------------------------------------------------------
def own_counts(rounds: list[list[int]], drafts_per_round: int) -> dict:
    """vLLM's counters recomputed from the own loop's rounds (accepted drafts per round, per prompt): drafts, and
    per draft position k the rounds that accepted at least k drafts."""
    flat = [n for prompt in rounds for n in prompt]
    return {"drafts": len(flat), "accepted": sum(flat),
            "accepted_per_pos": [sum(n > k for n in flat) for k in range(drafts_per_round)]}


def summed(counters: list[dict], drafts_per_round: int) -> dict:
    per_pos = [0] * drafts_per_round
    for c in counters:
        per_pos = [a + b for a, b in zip(per_pos, c["accepted_per_pos"] + [0] * drafts_per_round)]
    return {"drafts": sum(c["drafts"] for c in counters), "accepted": sum(c["accepted"] for c in counters),
            "accepted_per_pos": per_pos}


def rates(counts: dict) -> dict:
    """a_k (conditional acceptance per position), the unconditional rate per position and tau from counters."""
    drafts, per_pos = counts["drafts"], counts["accepted_per_pos"]
    reached = [drafts] + per_pos[:-1]
    return {"a_k": [p / r if r else 0.0 for p, r in zip(per_pos, reached)],
            "rate_k": [p / drafts if drafts else 0.0 for p in per_pos],
            "tau": 1 + counts["accepted"] / drafts if drafts else 0.0}


# -- the contract ------------------------------------------------------------------------------------------------
def _get(config: dict, dotted: str):
    node = config
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def export_contract(folder: Path) -> dict:
    """The contract keys of an exported drafter folder as an engine reads them (d2t as a digest of its values)."""
    config = json.loads((Path(folder) / "config.json").read_text())
    out = {k: _get(config, k) for k in CONTRACT + ENGINE_ONLY if k != "d2t"}
    with safe_open(str(Path(folder) / "model.safetensors"), "pt") as f:
        out["d2t"] = (hashlib.sha256(f.get_tensor("d2t").long().numpy().tobytes()).hexdigest()[:16]
                      if "d2t" in f.keys() else None)
    return out


def drafter_contract(drafter) -> dict:
    """The same keys for the drafter the own loop runs (what it was trained as)."""
    config = drafter.config.to_dict()
    out = {k: _get(config, k) for k in CONTRACT + ENGINE_ONLY if k != "d2t"}
    ids = drafter.draft_to_target
    full = ids is None or len(ids) == drafter.config.vocab_size
    out["draft_vocab_size"] = None if full else len(ids)
    out["d2t"] = None if full else hashlib.sha256(
        (ids.cpu().long() - torch.arange(len(ids))).numpy().tobytes()).hexdigest()[:16]
    return out


def likely_keys(served: dict, own: dict) -> list[str]:
    """Contract keys that differ between the export the engine served and the drafter the own loop ran, then keys
    only the engine honours that make its drafter something the own loop is not (causal, windowed)."""
    differ = [k for k in CONTRACT if served.get(k) != own.get(k)]
    engine_only = [k for k in ENGINE_ONLY if served.get(k) not in (None, False, [], 0)
                   and not (k == "layer_types" and all(t == "full_attention" for t in served[k]))]
    return differ + engine_only


# -- the gate ----------------------------------------------------------------------------------------------------
def gate(own: dict, served: dict, dtype: str, tolerance: float, outputs_ok: bool, served_contract: dict,
         own_contract: dict) -> dict:
    """The parity verdict of one eval set: {"pass": bool, "line": one line, "likely_keys": [...]}.

    float32: the counters equal (drafts and accepted per position) and every served output is exact. Reduced
    precision: every |rate_k served - rate_k own| <= tolerance (the unconditional acceptance per position), tau
    within tolerance relative, and no output wrong beyond near-ties."""
    ro, rs = rates(own), rates(served)
    if dtype == "float32":
        ok = own["drafts"] == served["drafts"] and own["accepted_per_pos"] == served["accepted_per_pos"]
        rule = "counters equal (float32)"
    else:
        diffs = [abs(a - b) for a, b in zip(ro["rate_k"], rs["rate_k"])]
        ok = max(diffs, default=0.0) <= tolerance and abs(rs["tau"] - ro["tau"]) <= tolerance * ro["tau"]
        rule = f"per-position rates within {tolerance} ({dtype})"
    ok = ok and outputs_ok
    keys = likely_keys(served_contract, own_contract)
    if ok:
        line = f"parity: served acceptance equals the own loop's ({rule}; tau {rs['tau']:.3f})"
        if keys:
            line += f"; note: the export differs from the drafter in {', '.join(keys)}"
    else:
        where = (f"served tau {rs['tau']:.3f} a_k {[round(x, 3) for x in rs['a_k']]} vs own loop tau {ro['tau']:.3f} "
                 f"a_k {[round(x, 3) for x in ro['a_k']]}"
                 + ("" if outputs_ok else "; served outputs are not exact"))
        if keys:
            cause = "; ".join(f"{k} ({WHAT.get(k, 'a contract key')}): export {served_contract.get(k)!r}, "
                              f"own loop {own_contract.get(k)!r}" for k in keys)
        elif dtype != "float32":
            cause = (f"none differs between the export and the drafter; in {dtype} the engines round differently: "
                     "rerun in float32 (target.dtype=float32), where a pass means numerics and a failure a contract "
                     "key the engine reads differently")
        else:  # the same export read differently: the symptom says where to look first
            first = rs["rate_k"][0] if rs["rate_k"] else 0.0
            cause = ("dflash_config.target_layer_ids or dflash_config.mask_token_id (position 1 collapses: the "
                     "engine reads the context features or the mask slot differently)"
                     if first < 0.5 * (ro["rate_k"][0] if ro["rate_k"] else 0.0) else
                     "rope_theta / rope_scaling or the causal flag (later positions part first)")
        line = f"PARITY FAILED: {where}; likely contract key: {cause}"
    return {"pass": ok, "rule": rule, "line": line, "likely_keys": keys}


# -- serving -----------------------------------------------------------------------------------------------------
def _median(xs):
    return statistics.median(xs) if xs else 0.0


class ServedEval:
    """Two vLLM engines on the target (plain, and with the exported drafter), open for every eval set of a run."""

    def __init__(self, cache_dir, target_dir: Path, drafter_dir: Path, dtype: str, block_size: int,
                 max_model_len: int, threads: int, log_file: Path):
        common = dict(model=target_dir, dtype=dtype, max_model_len=max_model_len, threads=threads, log_file=log_file)
        self.block_size, self.drafter_dir = block_size, drafter_dir
        self.plain = VLLMEngine(cache_dir, **common)
        try:
            self.spec = VLLMEngine(cache_dir, speculative=speculative_config(drafter_dir, block_size), **common)
        except BaseException:
            self.plain.close()
            raise

    def close(self) -> None:
        self.plain.close()
        self.spec.close()

    def run(self, prompts: list[list[int]], max_new_tokens: int, eos_ids, repeats: int, batch: int,
            label: str = "") -> dict:
        """Greedy decodes of `prompts`: per prompt A B B A (plain, spec, spec, plain) x repeats after a warm-up of
        each, at batch 1; then `batch` prompts at a time, the same order (0: no batched timing). Counters and
        outputs of the first speculative run of each prompt."""
        stop = sorted(eos_ids)
        go = lambda engine, ps, batched=False: engine.generate(ps, max_new_tokens, stop, batch=batched)  # noqa: E731
        go(self.plain, prompts[:1]), go(self.spec, prompts[:1])
        plain_s, spec_s, plain_out, spec_out, counters = [], [], [], [], []
        bar = Progress(f"served {label}", len(prompts), "prompt")
        for p in prompts:
            for r in range(repeats):
                a1, s1, s2, a2 = go(self.plain, [p]), go(self.spec, [p]), go(self.spec, [p]), go(self.plain, [p])
                if r == 0:
                    plain_out.append(a1["outputs"][0])
                    spec_out.append(s1["outputs"][0])
                    counters.append(s1["spec"][0])
                for res, secs in ((a1, plain_s), (a2, plain_s), (s1, spec_s), (s2, spec_s)):
                    secs.append(res["seconds"][0] / max(1, len(res["outputs"][0])))
            bar.update(1)
        bar.close()
        out = {"outputs_plain": plain_out, "outputs_spec": spec_out, "counters": counters,
               "tokens_per_s_plain": 1 / _median(plain_s) if plain_s else 0.0,
               "tokens_per_s_spec": 1 / _median(spec_s) if spec_s else 0.0}
        out["speedup"] = out["tokens_per_s_spec"] / out["tokens_per_s_plain"] if plain_s else 0.0
        if batch > 1:
            group = (prompts * (batch // len(prompts) + 1))[:batch]  # a full batch even from few prompts
            runs = {"plain": [], "spec": []}
            for engine, key in ((self.plain, "plain"), (self.spec, "spec"), (self.spec, "spec"),
                                (self.plain, "plain")):
                res = go(engine, group, True)
                runs[key].append(sum(len(o) for o in res["outputs"]) / res["seconds"][0])
            out.update(batch=batch, tokens_per_s_plain_batched=_median(runs["plain"]),
                       tokens_per_s_spec_batched=_median(runs["spec"]))
            out["speedup_batched"] = out["tokens_per_s_spec_batched"] / out["tokens_per_s_plain_batched"]
        return out


def compare(served: dict, prompts: list[dict], own_rounds: list[list[int]], own_spec: list[list[int]],
            own_ar: list[list[int]], drafts_per_round: int, dtype: str, judge: ExactnessJudge, tolerance: float,
            served_contract: dict, own_contract: dict, teacher_forced_a_k: list[float], own_a_k: list[float]) -> dict:
    """The served figures of one eval set beside the own loop's, with the exactness of every served output and
    the gate's verdict.

    Reduced precision: a decode that parted from the reference at a near-tie runs other tokens from there on, so
    its rounds are not comparable; the gate compares the prompts whose own and served speculative outputs both equal
    the own autoregressive reference (the same token paths: what still differs is the engines' rounding in the
    drafter and the verify), and the whole set's figures are reported beside (all prompts when none is left)."""
    near_ties, wrong = [], []
    for p, ref, plain, spec in zip(prompts, own_ar, served["outputs_plain"], served["outputs_spec"]):
        for what, other in (("vLLM plain", plain), ("vLLM speculative", spec)):
            v = judge.classify(p["prompt_ids"], ref, other)
            if v.kind != IDENTICAL:
                (near_ties if v.kind == NEAR_TIE else wrong).append({"prompt": p["id"], "run": what,
                                                                     "position": v.position, **v.detail})
    spec_equals_plain = sum(a == b for a, b in zip(served["outputs_plain"], served["outputs_spec"]))
    same_path = [i for i, (ref, own, spec) in enumerate(zip(own_ar, own_spec, served["outputs_spec"]))
                 if ref == own == spec]
    gated = same_path if dtype != "float32" and same_path else list(range(len(prompts)))
    counts_served = summed(served["counters"], drafts_per_round)
    counts_own = own_counts(own_rounds, drafts_per_round)
    outputs_ok = not wrong and (dtype != "float32" or not near_ties)
    verdict = gate(own_counts([own_rounds[i] for i in gated], drafts_per_round),
                   summed([served["counters"][i] for i in gated], drafts_per_round), dtype, tolerance, outputs_ok,
                   served_contract, own_contract)
    verdict["prompts_compared"] = len(gated)
    plain_off = [w for w in wrong if w["run"] == "vLLM plain"]
    if plain_off and not verdict["pass"]:  # the engine decodes the target itself differently: no drafter key to blame
        first = min(w["position"] for w in plain_off)
        verdict["line"] = (verdict["line"].split("; likely contract key:")[0]
                           + f"; cause: the engine's plain decoding (no drafter) already differs from the target's "
                             f"own on {len(plain_off)} of {len(prompts)} prompts, from output position {first}: the "
                             "engine runs this target differently (its model code or kernels), not a drafter "
                             "contract key")
        verdict["likely_keys"] = []
    if len(gated) < len(prompts):
        verdict["line"] += f" (on the {len(gated)} of {len(prompts)} prompts whose decodes took the same tokens)"
    rs, ro = rates(counts_served), rates(counts_own)
    res = {
        "prompts": len(prompts),
        "a_k_served": rs["a_k"], "a_k_own": ro["a_k"], "a_k_own_reported": own_a_k,
        "a_k_teacher_forced": teacher_forced_a_k,
        "tau_served": rs["tau"], "tau_own": ro["tau"],
        "counters_served": counts_served, "counters_own": counts_own,
        "counters_served_per_prompt": served["counters"], "same_path_prompts": same_path,
        "spec_identical_to_plain": spec_equals_plain, "outputs_compared": 2 * len(prompts),
        "near_ties": near_ties, "wrong": wrong,
        "gate": verdict,
        **{k: v for k, v in served.items() if not k.startswith(("outputs", "counters"))},
    }
    (log.info if verdict["pass"] else log.error)("%s", verdict["line"])
    return res
