"""Served acceptance: the exported drafter in vLLM on the eval's prompts, beside the project's own exact loop, and
the parity gate between the two (docs/metrics.md, 'Served acceptance').

A drafter whose training acceptance does not survive serving nearly always differs in a contract detail between
trainer and engine (a tap off by one, the mask token, RoPE, the causal flag, the draft vocabulary map), not in
quality. Both engines verify greedily, so on the same prompts in float32 they must run the same rounds: vLLM's
counters (drafts, accepted tokens per draft position) must equal the own loop's counts exactly, and vLLM's
speculative outputs must equal its plain decoding and the project's autoregressive references. In reduced precision
kernels round differently: outputs may part at near-ties (classified as the own eval does) and the per-position
acceptance must agree within eval.served.tolerance. A failed gate says so in one line naming the likely contract key.

At temperature > 0 (`sampled_set`) acceptance is random: the own loop decodes each prompt with several seeds under
the acceptance rule the engine uses (vLLM's draft_sample_method "greedy" is the own loop's "greedy_draft" rule,
"probabilistic" its "sampled" rule; eval/decode.py), the engine serves each prompt seeded and unseeded, and the gate
is statistical (eval/significance.py): per-position acceptance equal within noise, and the served samples
distributed as the target's own. A failure the engine's own self-checks explain is named as the engine's.
"""
from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from dflash_pipeline.runtime.progress import Progress
from dflash_pipeline.eval import significance
from dflash_pipeline.eval.decode import ACCEPTANCE_RULES, speculative
from dflash_pipeline.eval.exactness import IDENTICAL, NEAR_TIE, ExactnessJudge
from dflash_pipeline.eval.errors import EvalError
from dflash_pipeline.eval.metrics import median
from dflash_pipeline.models import llamacpp_engine
from dflash_pipeline.models.export import trained_scales
from dflash_pipeline.models.target import target_folder
from dflash_pipeline.models.vllm_engine import VLLMEngine, close_engines, speculative_config

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
    "input_embedding_scale": "the scale of the drafter's input embeddings (dflash_config; llama.cpp reads it for "
                             "DFlash and DFlash2, absent: sqrt(hidden) for a Gemma target, else 1; vLLM's DFlash2 "
                             "reads it, absent: 1; vLLM's DFlash reads none: 1)",
}
SCALE = "input_embedding_scale"  # the export's (dflash_config, top level, else 1); the own loop's embedding's


# -- counts ------------------------------------------------------------------------------------------------------
def own_counts(rounds: list[list[int]], drafts_per_round: int, budget: int | None = None) -> dict:
    """vLLM's counters recomputed from the own loop's rounds (accepted drafts per round, per prompt): drafts, and
    per draft position k the rounds that accepted at least k drafts.

    budget (llama.cpp): the engine drafts at most (tokens still to generate) - 1 in a round, where the own loop
    drafts a whole block and cuts the output; the own rounds are counted as such an engine would run them, up to the
    first round the budget cuts short (after it the paths' rounds no longer line up: the last one or two of a
    prompt)."""
    flat = []
    for prompt in rounds:
        produced = 1  # the first token comes from the prefill, in both
        for n in prompt:
            most = drafts_per_round if budget is None else min(drafts_per_round, budget - produced - 1)
            if most <= 0:
                break
            flat.append(min(n, most))
            produced += n + 1
            if n > most:
                break
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


def export_contract(folder: Path, engine: str = "vllm") -> dict:
    """The contract keys of an exported drafter folder as `engine` (vllm, llamacpp) reads them (d2t as a digest of
    its values). vLLM's DFlash (not DFlash2) reads no embedding scale: it drafts from the target's unscaled
    embeddings, so a Gemma target's drafter (trained with sqrt(hidden)) differs there in this key."""
    config = json.loads((Path(folder) / "config.json").read_text())
    out = {k: _get(config, k) for k in CONTRACT + ENGINE_ONLY if k != "d2t"}
    scale = _get(config, f"dflash_config.{SCALE}")
    out[SCALE] = float(scale if scale is not None else config.get(SCALE, 1.0))
    if engine == "vllm" and config.get("architectures") == ["DFlashDraftModel"]:
        out[SCALE] = 1.0
    with safe_open(str(Path(folder) / "model.safetensors"), "pt") as f:
        out["d2t"] = (hashlib.sha256(f.get_tensor("d2t").long().numpy().tobytes()).hexdigest()[:16]
                      if "d2t" in f.keys() else None)
    return out


def drafter_contract(drafter) -> dict:
    """The same keys for the drafter the own loop runs (what it was trained as)."""
    config = drafter.config.to_dict()
    out = {k: _get(config, k) for k in CONTRACT + ENGINE_ONLY if k != "d2t"}
    out[SCALE] = trained_scales(drafter)[SCALE]  # Gemma's scaled embedding module: sqrt(hidden)
    ids = drafter.draft_to_target
    full = ids is None or len(ids) == drafter.config.vocab_size
    out["draft_vocab_size"] = None if full else len(ids)
    out["d2t"] = None if full else hashlib.sha256(
        (ids.cpu().long() - torch.arange(len(ids))).numpy().tobytes()).hexdigest()[:16]
    return out


def likely_keys(served: dict, own: dict) -> list[str]:
    """Contract keys that differ between the export the engine served and the drafter the own loop ran, then keys
    only the engine honours that make its drafter something the own loop is not (causal, windowed)."""
    differ = [k for k in CONTRACT + (SCALE,) if served.get(k) != own.get(k)]
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
        apart = [k for k, (a, b) in enumerate(zip(own["accepted_per_pos"], served["accepted_per_pos"])) if a != b]
    else:
        diffs = [abs(a - b) for a, b in zip(ro["rate_k"], rs["rate_k"])]
        ok = max(diffs, default=0.0) <= tolerance and abs(rs["tau"] - ro["tau"]) <= tolerance * ro["tau"]
        rule = f"per-position rates within {tolerance} ({dtype})"
        apart = [k for k, d in enumerate(diffs) if d > tolerance]
    ok = ok and outputs_ok
    keys = likely_keys(served_contract, own_contract)
    if ok:
        line = f"parity: served acceptance equals the own loop's ({rule}; tau {rs['tau']:.3f})"
        if keys:
            line += f"; note: the export differs from the drafter in {', '.join(keys)}"
    else:
        first = ""
        if apart:  # where the two part first, and which side moved (float32: by the counts)
            k = apart[0]
            pair = ((served["accepted_per_pos"][k], own["accepted_per_pos"][k]) if dtype == "float32" else
                    (rs["rate_k"][k], ro["rate_k"][k]))
            side = "the engine accepts less" if pair[0] < pair[1] else "the engine accepts more"
            first = (f"; first apart at draft position {k + 1}: served rate {rs['rate_k'][k]:.3f} vs own "
                     f"{ro['rate_k'][k]:.3f} ({side})")
        where = (f"served tau {rs['tau']:.3f} a_k {[round(x, 3) for x in rs['a_k']]} vs own loop tau {ro['tau']:.3f} "
                 f"a_k {[round(x, 3) for x in ro['a_k']]}{first}"
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
class ServedEval:
    """vLLM engines on the target (plain, and with the exported drafter), open for every eval set of a run. At
    temperature > 0 only the speculative engine runs (plain=False). wait=False returns while the engines build (the
    first request waits for them): several ServedEvals then build side by side."""

    name = "vLLM"

    def __init__(self, cache_dir, target_dir: Path, drafter_dir: Path, dtype: str, block_size: int,
                 max_model_len: int, threads: int, log_file: Path, plain: bool = True,
                 draft_sample_method: str = "greedy", repair: bool = False, wait: bool = True):
        common = dict(model=target_dir, dtype=dtype, max_model_len=max_model_len, threads=threads, log_file=log_file,
                      repair=repair)
        self.block_size, self.drafter_dir = block_size, drafter_dir
        self._start(lambda: VLLMEngine(cache_dir, wait=False, **common) if plain else None,
                    lambda: VLLMEngine(cache_dir, speculative=speculative_config(drafter_dir, block_size,
                                                                                 draft_sample_method),
                                       wait=False, **common), wait)

    def _start(self, start_plain, start_spec, wait: bool = True) -> None:
        """Both engines started side by side (each factory returns one started with wait=False), then waited for;
        a failure closes whichever had started."""
        self.plain = start_plain()
        try:
            self.spec = start_spec()
            for engine in (self.plain, self.spec) if wait else ():
                if engine is not None:
                    engine.ready()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        close_engines(self.plain, getattr(self, "spec", None))

    def run_sampled(self, prompts: list[list[int]], max_new_tokens: int, eos_ids, temperature: float,
                    seeds: list[int], batch: int, label: str = "") -> dict:
        """Sampled decodes of `prompts` at batch 1: each prompt once per seed as a seeded request, and as many times
        unseeded; then (batch > 1) the unseeded requests `batch` at a time. Per decode its counters and output;
        per batch its counters (vLLM counts a batch as a whole)."""
        stop = sorted(eos_ids)
        out = {"seeded": [], "unseeded": [], "batched": []}
        bar = Progress(f"served T={temperature} {label}", 2 * len(seeds) * len(prompts), "decode")
        for kind, seed_list in (("seeded", seeds), ("unseeded", [None] * len(seeds))):
            for seed in seed_list:
                for p in prompts:
                    res = self.spec.generate([p], max_new_tokens, stop, temperature=temperature, seeds=[seed])
                    out[kind].append({**res["spec"][0], "output": res["outputs"][0], "seed": seed})
                    bar.update(1)
        bar.close()
        if batch > 1:
            requests = [p for _ in seeds for p in prompts]
            for i in range(0, len(requests), batch):
                res = self.spec.generate(requests[i: i + batch], max_new_tokens, stop, batch=True,
                                         temperature=temperature)
                out["batched"].append(res["spec"][0])
        return out

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
               "tokens_per_s_plain": 1 / median(plain_s) if plain_s else 0.0,
               "tokens_per_s_spec": 1 / median(spec_s) if spec_s else 0.0}
        out["speedup"] = out["tokens_per_s_spec"] / out["tokens_per_s_plain"] if plain_s else 0.0
        if batch > 1:
            group = (prompts * (batch // len(prompts) + 1))[:batch]  # a full batch even from few prompts
            runs = {"plain": [], "spec": []}
            for engine, key in ((self.plain, "plain"), (self.spec, "spec"), (self.spec, "spec"),
                                (self.plain, "plain")):
                res = go(engine, group, True)
                runs[key].append(sum(len(o) for o in res["outputs"]) / res["seconds"][0])
            out.update(batch=batch, tokens_per_s_plain_batched=median(runs["plain"]),
                       tokens_per_s_spec_batched=median(runs["spec"]))
            out["speedup_batched"] = out["tokens_per_s_spec_batched"] / out["tokens_per_s_plain_batched"]
        return out


class LlamaCppServedEval(ServedEval):
    """The same runs through llama.cpp: llama-server on the target's GGUF, plain and with the drafter's GGUF
    (`--spec-type draft-dflash`), both converted here by llama.cpp's own converter (models/llamacpp_engine.py), one
    request at a time."""

    name = "llama.cpp"

    def __init__(self, cache_dir, target_dir: Path, drafter_dir: Path, block_size: int, max_model_len: int,
                 threads: int, log_file: Path, outtype: str = "f32", plain: bool = True):
        self.block_size, self.drafter_dir = block_size, drafter_dir
        folder = Path(cache_dir) / "llamacpp" / "gguf"
        self.target_gguf = llamacpp_engine.to_gguf(cache_dir, target_dir, folder, outtype, log_file=log_file)
        self.drafter_gguf = llamacpp_engine.to_gguf(cache_dir, drafter_dir, folder, outtype, target_dir=target_dir,
                                                    log_file=log_file)
        common = dict(threads=threads, ctx=min(max_model_len, 8192), log_file=log_file, block_size=block_size)
        server = llamacpp_engine.LlamaServer
        self._start(lambda: server(cache_dir, self.target_gguf, wait=False, **common) if plain else None,
                    lambda: server(cache_dir, self.target_gguf, self.drafter_gguf, wait=False, **common))


# -- at temperature > 0 -------------------------------------------------------------------------------------------
ENGINE_BUGS = {  # models/vllm_worker.py's checks, as a verdict names them
    "rejection_temperature": "its CPU build's rejection sampler divides the target's logits by uninitialised "
                             "memory instead of the temperature (the per-draft expansion writes into a discarded "
                             "int64 copy): the target's probabilities at T > 0 are wrong, and with them acceptance and the "
                             "served samples",
}
RULE_OF = {"greedy": "greedy_draft", "probabilistic": "sampled"}  # vLLM draft_sample_method -> own loop's rule


def own_sampled(target, drafter, prompts: list[list[int]], block_size: int, max_new_tokens: int,
                temperature: float, seeds: list[int], rule: str, budget: int | None = None) -> list[dict]:
    """The own loop's sampled decodes of every prompt with every seed under acceptance `rule`: per decode its
    engine-style counters (own_counts, with the engine's draft budget) and output."""
    out = []
    bar = Progress(f"own loop T={temperature} {rule}", len(seeds) * len(prompts), "decode")
    for seed in seeds:
        for i, p in enumerate(prompts):
            gen = torch.Generator().manual_seed(1_000_003 * seed + i)
            res = speculative(target, drafter, p, max_new_tokens, block_size, temperature, gen, acceptance=rule)
            out.append({**own_counts([res.accepted], block_size - 1, budget), "output": res.tokens, "seed": seed})
            bar.update(1)
    bar.close()
    return out


def distribution(target, prompts: list[list[int]], decodes: list[dict], temperature: float) -> dict:
    """The PIT uniformity of decodes' sampled tokens under the target (eval/significance.py); decodes follow
    `prompts` in order, cycling."""
    gen = torch.Generator().manual_seed(0)
    u = []
    for i, d in enumerate(decodes):
        u += significance.pit_values(target.model, prompts[i % len(prompts)], d["output"], temperature, gen)
    return significance.uniformity(u)


def sampled_gate(own: list[dict], served: list[dict], positions: int, alpha: float, rule: str, temperature: float,
                 served_distribution: dict, engine: dict, other_rule: list[dict] | None = None) -> dict:
    """The verdict at temperature > 0: per-position acceptance equal within noise (Holm at `alpha`) and the served
    samples distributed as the target's (PIT chi-square p > alpha). engine: {"version", "checks", "repaired"}."""
    test = significance.compare_positions(own, served, positions, alpha)
    dist_p = served_distribution.get("p")
    biased = dist_p is not None and dist_p <= alpha
    ok = not test["differ"] and not biased
    ts, to = significance.rate_table(served, positions), significance.rate_table(own, positions)
    fmt = lambda t: f"{t['tau']:.3f}" + (f" [{t['tau_low']:.3f}, {t['tau_high']:.3f}]"  # noqa: E731
                                         if t["tau_low"] is not None else "")
    broken = [k for k, right in engine.get("checks", {}).items() if not right and k not in engine.get("repaired", [])]
    if ok:
        line = (f"parity at T={temperature}: served acceptance equals the own loop's {rule} rule within noise "
                f"(per-position tests, Holm alpha {alpha}; {len(served)} served and {len(own)} own decodes; tau "
                f"served {fmt(ts)}, own {fmt(to)})" + ("" if dist_p is None else
                f"; served samples follow the target's distribution (PIT chi-square p {dist_p:.3f})"))
    else:
        line = (f"PARITY FAILED at T={temperature}: "
                + (f"positions {test['differ']} differ (served a_k "
                   f"{[round(a['rate'] or 0.0, 3) for a in ts['a_k'][:4]]} vs own {rule} "
                   f"{[round(a['rate'] or 0.0, 3) for a in to['a_k'][:4]]}; tau served {fmt(ts)}, own {fmt(to)})"
                   if test["differ"] else "acceptance within noise")
                + (f"; served samples are NOT distributed as the target's (PIT chi-square p {dist_p:.2g})"
                   if biased else ""))
        if broken:
            line += "; cause: the engine's bug, vLLM " + str(engine.get("version")) + ": " + "; ".join(
                ENGINE_BUGS.get(k, k) for k in broken) + " (eval.served.repair=true serves it mended)"
        elif not test["differ"]:  # acceptance agrees, the samples do not: how the engine samples the target
            line += ("; likely cause: the engine samples the target from another distribution than softmax(logits / "
                     "T) (its sampler chain: truncation such as top-k / top-p / min-p, penalties)")
        elif other_rule is not None and not significance.compare_positions(other_rule, served, positions,
                                                                           alpha)["differ"]:
            line += ("; served matches the own loop's other acceptance rule: the engine's draft sampling is not "
                     "the one configured (eval.served.draft_sample_method)")
        else:
            line += ("; likely cause: a contract key the engine reads differently (check the greedy gate first: "
                     "eval.temperature=0)")
    return {"pass": ok, "line": line, "positions": test, "distribution_p": dist_p, "engine_bugs": broken}


def sampled_set(engine: ServedEval, target, drafter, prompts: list[list[int]], block_size: int,
                max_new_tokens: int, temperature: float, seeds: list[int], batch: int, alpha: float,
                draft_sample_method: str, label: str = "", own: dict | None = None, budget: int | None = None) -> dict:
    """One eval set at temperature > 0: the engine's decodes (seeded, unseeded, batched), the own loop's under both
    acceptance rules, per-position rates with intervals for each, the served samples' distribution check and the
    gate against the own loop's rule that matches the engine's draft sampling. own: the own loop's decodes per rule
    when already run (own_sampled with the same arguments)."""
    served = engine.run_sampled(prompts, max_new_tokens, target.eos_ids, temperature, seeds, batch, label)
    rule = RULE_OF[draft_sample_method]
    own = own or {r: own_sampled(target, drafter, prompts, block_size, max_new_tokens, temperature, seeds, r, budget)
                  for r in ACCEPTANCE_RULES}
    both = served["seeded"] + served["unseeded"]
    info = {"version": engine.spec.version, "checks": engine.spec.checks, "repaired": engine.spec.repaired}
    dist = {"served": distribution(target, prompts, both, temperature),
            "own": distribution(target, prompts, own[rule], temperature)}
    k = block_size - 1
    other = next(r for r in ACCEPTANCE_RULES if r != rule)
    verdict = sampled_gate(own[rule], both, k, alpha, rule, temperature, dist["served"], info, own[other])
    (log.info if verdict["pass"] else log.error)("%s: %s", label, verdict["line"])
    strip = lambda ds: [{k_: v for k_, v in d.items() if k_ != "output"} for d in ds]  # noqa: E731
    pooled, mine = significance.rate_table(both, k), significance.rate_table(own[rule], k)
    return {"temperature": temperature, "a_k_served": [a["rate"] or 0.0 for a in pooled["a_k"]],
            "a_k_own": [a["rate"] or 0.0 for a in mine["a_k"]], "tau_served": pooled["tau"], "tau_own": mine["tau"], "seeds": seeds, "rule": rule, "draft_sample_method": draft_sample_method,
            "engine": info, "prompts": len(prompts),
            "rates": {"own_sampled": significance.rate_table(own["sampled"], k),
                      "own_greedy_draft": significance.rate_table(own["greedy_draft"], k),
                      "served_seeded": significance.rate_table(served["seeded"], k),
                      "served_unseeded": significance.rate_table(served["unseeded"], k),
                      **({"served_batched": significance.rate_table(served["batched"], k)}
                         if served["batched"] else {})},
            "seeded_vs_unseeded": significance.compare_positions(served["seeded"], served["unseeded"], k, alpha),
            "distribution": dist, "gate": verdict,
            "decodes": {"served_seeded": strip(served["seeded"]), "served_unseeded": strip(served["unseeded"]),
                        "own": {r: strip(v) for r, v in own.items()}}}


@dataclass
class OwnSet:
    """The own loop's chain runs of one eval set, as the served eval compares them."""

    prompts: list[dict]
    ar: list[list[int]]  # the first autoregressive reply per prompt: the exactness reference
    rounds: list[list[int]]  # accepted drafts per round of the first speculative run
    spec: list[list[int]]  # that run's output
    a_k: list[float]  # the own loop's a_k online, as reported
    a_k_teacher_forced: list[float]


@dataclass(frozen=True)
class Gate:
    """What the greedy parity gate judges with."""

    drafts_per_round: int
    dtype: str
    tolerance: float  # eval.served.tolerance: reduced precision's allowance per position
    judge: ExactnessJudge
    served_contract: dict  # export_contract of the export the engine loads
    own_contract: dict  # drafter_contract of the drafter the own loop runs
    engine: str = "vLLM"  # the serving engine, as the verdicts name it
    budget: int | None = None  # llama.cpp: max_new_tokens, whose remainder caps each round's drafts (own_counts)


def compare(served: dict, own: OwnSet, g: Gate) -> dict:
    """The served figures of one eval set beside the own loop's, with the exactness of every served output and
    the gate's verdict.

    Reduced precision: a decode that parted from the reference at a near-tie runs other tokens from there on, so
    its rounds are not comparable; the gate compares the prompts whose own and served speculative outputs both equal
    the own autoregressive reference (the same token paths: what still differs is the engines' rounding in the
    drafter and the verify), and the whole set's figures are reported beside (all prompts when none is left)."""
    prompts, own_ar, own_spec, own_rounds = own.prompts, own.ar, own.spec, own.rounds
    drafts_per_round, dtype, judge = g.drafts_per_round, g.dtype, g.judge
    near_ties, wrong = [], []
    for p, ref, plain, spec in zip(prompts, own_ar, served["outputs_plain"], served["outputs_spec"]):
        for what, other in ((f"{g.engine} plain", plain), (f"{g.engine} speculative", spec)):
            v = judge.classify(p["prompt_ids"], ref, other)
            if v.kind != IDENTICAL:
                (near_ties if v.kind == NEAR_TIE else wrong).append({"prompt": p["id"], "run": what,
                                                                     "position": v.position, **v.detail})
    spec_equals_plain = sum(a == b for a, b in zip(served["outputs_plain"], served["outputs_spec"]))
    same_path = [i for i, (ref, own, spec) in enumerate(zip(own_ar, own_spec, served["outputs_spec"]))
                 if ref == own == spec]
    gated = same_path if dtype != "float32" and same_path else list(range(len(prompts)))
    counts_served = summed(served["counters"], drafts_per_round)
    counts_own = own_counts(own_rounds, drafts_per_round, g.budget)
    outputs_ok = not wrong and (dtype != "float32" or not near_ties)
    verdict = gate(own_counts([own_rounds[i] for i in gated], drafts_per_round, g.budget),
                   summed([served["counters"][i] for i in gated], drafts_per_round), dtype, g.tolerance, outputs_ok,
                   g.served_contract, g.own_contract)
    verdict["prompts_compared"] = len(gated)
    plain_off = [w for w in wrong if w["run"] == f"{g.engine} plain"]
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
        "a_k_served": rs["a_k"], "a_k_own": ro["a_k"], "a_k_own_reported": own.a_k,
        "a_k_teacher_forced": own.a_k_teacher_forced,
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


# -- the eval stage's served step --------------------------------------------------------------------------------
@dataclass(frozen=True)
class ServeSettings:
    """What the served eval of a run reads from its config and target (eval/stage.py builds it)."""

    cache_dir: str
    target_dir: Path  # the target's folder, as vLLM loads it
    drafter_dir: Path  # the export vLLM loads
    dtype: str
    block_size: int
    max_model_len: int
    threads: int
    max_new_tokens: int
    online_prompts: int  # the first prompts of each set, those the own loop timed
    repeats: int  # eval.timing_repeats
    temperature: float
    seed: int
    served: object  # the eval.served section (conf/schema.py ServedConfig)

    @classmethod
    def of(cls, cfg, target, drafter_dir: Path, block_size: int) -> ServeSettings:
        e = cfg.eval
        return cls(cache_dir=cfg.cache_dir, target_dir=target_folder(cfg.target, cfg.cache_dir),
                   drafter_dir=drafter_dir, dtype=target.dtype, block_size=block_size,
                   max_model_len=target.config.max_position_embeddings,
                   threads=e.num_threads or torch.get_num_threads(), max_new_tokens=e.max_new_tokens,
                   online_prompts=e.online_prompts, repeats=e.timing_repeats, temperature=e.temperature,
                   seed=e.seed, served=e.served)


def serve(s: ServeSettings, target, drafter, judge: ExactnessJudge, prompt_sets: dict[str, list[dict]],
          own_runs: dict, results: dict) -> dict:
    """The exported drafter served by the engine (eval.served.engine: vllm, llamacpp) on each set's online prompts,
    beside the own loop's chain runs of the same prompts: per-position acceptance served / own loop / teacher-forced,
    exactness, speed, and the parity gate's verdict per set (greedy: counters equal in float32 in vLLM, within
    eval.served.tolerance in llama.cpp, whose kernels round differently from torch's even in float32; temperature
    > 0: the statistical gate over seeds)."""
    llamacpp = str(s.served.engine) == "llamacpp"  # eval/stage.py check_llamacpp refused what it does not run
    sampled = s.temperature > 0  # statistical: several seeds per prompt; only the speculative engine runs
    out = {"engine": str(s.served.engine), "target_dir": str(s.target_dir), "threads": s.threads, "dtype": s.dtype,
           "tolerance": s.served.tolerance, "sets": {}}
    log_file = Path(s.cache_dir) / ("llamacpp" if llamacpp else "vllm") / "engine.log"
    log_file.parent.mkdir(parents=True, exist_ok=True)
    log_file.unlink(missing_ok=True)  # this run's engines only
    name = LlamaCppServedEval.name if llamacpp else ServedEval.name
    log.info("serving %s on %s in %s (%s, %d threads; engine log %s)", s.drafter_dir, s.target_dir, name, s.dtype,
             s.threads, log_file)
    # llama.cpp's float32 kernels are not torch's: its gate is the reduced-precision one (rates within tolerance,
    # outputs exact but for near-ties), in float32 too
    gate_dtype = f"{s.dtype} in llama.cpp" if llamacpp else s.dtype
    gate = None if sampled else Gate(s.block_size - 1, gate_dtype, s.served.tolerance,
                                     judge.near_ties_allowed() if llamacpp else judge,
                                     export_contract(s.drafter_dir, str(s.served.engine)), drafter_contract(drafter),
                                     name,
                                     s.max_new_tokens if llamacpp else None)
    if llamacpp:
        engine = LlamaCppServedEval(s.cache_dir, s.target_dir, s.drafter_dir, s.block_size, s.max_model_len,
                                    s.threads, log_file, outtype="f32" if s.dtype == "float32" else "f16",
                                    plain=not sampled)
        out["gguf"] = {"target": str(engine.target_gguf), "drafter": str(engine.drafter_gguf)}
    else:
        engine = ServedEval(s.cache_dir, s.target_dir, s.drafter_dir, s.dtype, s.block_size, s.max_model_len,
                            s.threads, log_file, plain=not sampled,
                            draft_sample_method=s.served.draft_sample_method if sampled else "greedy",
                            repair=s.served.repair)
    try:
        for label, prompts in prompt_sets.items():
            timed = prompts[: s.online_prompts]
            out["sets"][label] = (_sampled(s, engine, target, drafter, timed, label) if sampled else
                                  _greedy(s, engine, gate, target, timed, label, own_runs, results))
    finally:
        engine.close()
    out["pass"] = all(r["gate"]["pass"] for r in out["sets"].values())
    if not out["pass"] and s.served.strict:
        raise EvalError("; ".join(r["gate"]["line"] for r in out["sets"].values() if not r["gate"]["pass"])
                        + " (eval.served.strict=true)")
    return out


def _sampled(s: ServeSettings, engine: ServedEval, target, drafter, timed: list[dict], label: str) -> dict:
    seeds = [s.seed + i for i in range(s.served.seeds)]
    llamacpp = isinstance(engine, LlamaCppServedEval)  # one request at a time; drafts capped by the tokens left
    return sampled_set(engine, target, drafter, [p["prompt_ids"] for p in timed], s.block_size, s.max_new_tokens,
                       s.temperature, seeds, 0 if llamacpp else s.served.batch, s.served.alpha,
                       s.served.draft_sample_method, label, budget=s.max_new_tokens if llamacpp else None)


def _greedy(s: ServeSettings, engine: ServedEval, gate: Gate, target, timed: list[dict], label: str, own_runs: dict,
            results: dict) -> dict:
    method = str(s.served.method)  # chain, or the selector walk the DFlash2 checkpoint runs in the engine
    ar, rounds, spec = own_runs[label][method]
    own = results["methods"][method][label]
    batch = 0 if isinstance(engine, LlamaCppServedEval) else s.served.batch  # llama.cpp: one request at a time
    served = engine.run([p["prompt_ids"] for p in timed], s.max_new_tokens, target.eos_ids, s.repeats, batch, label)
    res = compare(served, OwnSet(timed, ar, rounds, spec, own["a_k_online"],
                                 results["offline"][label]["methods"][method]["a_k"]), gate)
    fastest = min(own.get("ms_per_token_ar_by_dtype", {}).values(), default=own["ms_per_token_ar"])
    res["speedup_vs_own_fastest_ar"] = res["tokens_per_s_spec"] * fastest / 1e3
    return res
