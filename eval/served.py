"""Served acceptance, the eval stage's step: the exported drafter served by an engine pair (vLLM or llama.cpp,
eval/engines.py) on the eval's prompts, beside the project's own exact loop, and the parity gate between the two
(eval/gates.py; docs/metrics.md, 'Served acceptance').

A drafter whose training acceptance does not survive serving nearly always differs in a contract detail between
trainer and engine (a tap off by one, the mask token, RoPE, the causal flag, the draft vocabulary map), not in
quality. Engine and own loop verify greedily, so on the same prompts in float32 they must run the same rounds: the
engine's counters (drafts, accepted tokens per draft position) must equal the own loop's counts exactly, and its
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

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from dflash_pipeline.eval import significance
from dflash_pipeline.eval.engine_contract import drafter_contract, export_contract
from dflash_pipeline.eval.decode import ACCEPTANCE_RULES, speculative
from dflash_pipeline.eval.engines import EnginePair, LlamaCppPair, VLLMPair
from dflash_pipeline.eval.errors import EvalError
from dflash_pipeline.eval.exactness import ExactnessJudge
from dflash_pipeline.eval.gates import Gate, OwnSet, compare, own_counts, sampled_gate
from dflash_pipeline.eval.results import Served, SetResult
from dflash_pipeline.models.target_sources import target_folder
from dflash_pipeline.runtime.progress import Progress

log = logging.getLogger(__name__)


RULE_OF = {"greedy": "greedy_draft", "probabilistic": "sampled"}  # eval.served.draft_sample_method -> own rule
ENGINES = {"vllm": VLLMPair, "llamacpp": LlamaCppPair}  # eval.served.engine -> its pair


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


def sampled_set(engine: EnginePair, target, drafter, prompts: list[list[int]], block_size: int,
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
    verdict = sampled_gate(own[rule], both, k, alpha, rule, temperature, dist["served"], info, own[other],
                           seeds=len(seeds))
    (log.info if verdict["pass"] else log.error)("%s: %s", label, verdict["line"])
    strip = lambda ds: [{k_: v for k_, v in d.items() if k_ != "output"} for d in ds]  # noqa: E731
    pooled, mine = significance.rate_table(both, k), significance.rate_table(own[rule], k)
    return {"temperature": temperature, "a_k_served": [a["rate"] or 0.0 for a in pooled["a_k"]],
            "a_k_own": [a["rate"] or 0.0 for a in mine["a_k"]], "tau_served": pooled["tau"], "tau_own": mine["tau"],
            "seeds": seeds, "rule": rule, "draft_sample_method": draft_sample_method,
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
          own: dict[str, SetResult]) -> Served:
    """The exported drafter served by the engine (eval.served.engine: vllm, llamacpp) on each set's online prompts,
    beside the own loop's chain runs of the same prompts: per-position acceptance served / own loop / teacher-forced,
    exactness, speed, and the parity gate's verdict per set (greedy: counters equal in float32 in vLLM, within
    eval.served.tolerance in llama.cpp, whose kernels round differently from torch's even in float32; temperature
    > 0: the statistical gate over seeds)."""
    Pair = ENGINES[str(s.served.engine)]  # eval/stage.py check_llamacpp refused what llama.cpp does not run
    sampled = s.temperature > 0  # statistical: several seeds per prompt; only the speculative engine runs
    log_file = Path(s.cache_dir) / str(s.served.engine) / "engine.log"
    log_file.parent.mkdir(parents=True, exist_ok=True)
    log_file.unlink(missing_ok=True)  # this run's engines only
    log.info("serving %s on %s in %s (%s, %d threads; engine log %s)", s.drafter_dir, s.target_dir, Pair.name,
             s.dtype, s.threads, log_file)
    gate = None if sampled else _gate(s, Pair, judge, drafter)
    engine = _start(s, Pair, log_file, sampled)
    out = Served(str(s.served.engine), str(s.target_dir), s.threads, s.dtype, s.served.tolerance, engine.files())
    try:
        for label, prompts in prompt_sets.items():
            timed = prompts[: s.online_prompts]
            out.sets[label] = (_sampled(s, engine, target, drafter, timed, label) if sampled else
                               _greedy(s, engine, gate, target, own[label].methods[str(s.served.method)].own, label))
    finally:
        engine.close()
    if not out.passed and s.served.strict:
        raise EvalError("; ".join(out.failures()) + " (eval.served.strict=true)")
    return out


def _gate(s: ServeSettings, Pair: type[EnginePair], judge: ExactnessJudge, drafter) -> Gate:
    """The greedy gate for this engine. On torch's kernels (vLLM) the counters must equal the own loop's in float32;
    llama.cpp's float32 kernels are not torch's, so its gate is the reduced-precision one (rates within tolerance,
    outputs exact but for near-ties) in float32 too."""
    same = Pair.torch_kernels
    return Gate(s.block_size - 1, s.dtype if same else f"{s.dtype} in {Pair.name}", s.served.tolerance,
                judge if same else judge.near_ties_allowed(), export_contract(s.drafter_dir, str(s.served.engine)),
                drafter_contract(drafter), Pair.name, s.max_new_tokens if Pair.budgeted else None)


def _start(s: ServeSettings, Pair: type[EnginePair], log_file: Path, sampled: bool) -> EnginePair:
    """Both engines of the pair, each with the settings it reads (at temperature > 0 the speculative one alone)."""
    if Pair is LlamaCppPair:
        return LlamaCppPair(s.cache_dir, s.target_dir, s.drafter_dir, s.block_size, s.max_model_len, s.threads,
                            log_file, outtype="f32" if s.dtype == "float32" else "f16", plain=not sampled)
    return VLLMPair(s.cache_dir, s.target_dir, s.drafter_dir, s.dtype, s.block_size, s.max_model_len, s.threads,
                    log_file, plain=not sampled,
                    draft_sample_method=s.served.draft_sample_method if sampled else "greedy", repair=s.served.repair)


def _sampled(s: ServeSettings, engine: EnginePair, target, drafter, timed: list[dict], label: str) -> dict:
    seeds = [s.seed + i for i in range(s.served.seeds)]
    return sampled_set(engine, target, drafter, [p["prompt_ids"] for p in timed], s.block_size, s.max_new_tokens,
                       s.temperature, seeds, s.served.batch if engine.batches else 0, s.served.alpha,
                       s.served.draft_sample_method, label, budget=s.max_new_tokens if engine.budgeted else None)


def _greedy(s: ServeSettings, engine: EnginePair, gate: Gate, target, own: OwnSet, label: str) -> dict:
    """own: the own loop's runs of the served method (chain, or the selector walk the DFlash2 checkpoint runs in
    the engine) on this set's online prompts."""
    batch = s.served.batch if engine.batches else 0  # llama.cpp: one request at a time
    served = engine.run([p["prompt_ids"] for p in own.prompts], s.max_new_tokens, target.eos_ids, s.repeats, batch,
                        label)
    res = compare(served, own, gate)
    res["speedup_vs_own_fastest_ar"] = res["tokens_per_s_spec"] * own.ms_per_token_fastest_ar / 1e3
    return res
