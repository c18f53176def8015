"""What a round costs on this machine: the verify-cost curve the decoding policies calibrate on and the predicted
speedups are computed from (eval/policies.py measure_costs), measured for the calibration and again just before each
eval set's timing, at that set's decoding context."""
from __future__ import annotations

import logging
import statistics

from omegaconf import DictConfig

from dflash_pipeline.eval.methods import method
from dflash_pipeline.eval.policies import EvalContext, measure_costs
from dflash_pipeline.models.drafter import DFlashDrafter
from dflash_pipeline.models.target import Target

log = logging.getLogger(__name__)

COST_CONTEXT = 256  # context of the policies' verify-cost curve (each eval set measures its own: decode_context)


def eval_context(cfg: DictConfig, target: Target, drafter: DFlashDrafter, block_size: int, heldout: list[dict],
                 prompt_sets: dict[str, list[dict]]) -> EvalContext:
    """What the decoding policies calibrate on (eval/policies.py): the verify-cost curve measured now, and held-out
    teacher sequences that are none of the eval prompts."""
    used = {p["id"] for prompts in prompt_sets.values() for p in prompts}
    calibration = [it for it in heldout if it.get("id") not in used][: cfg.eval.policy.calibration_sequences]
    first = next(iter(prompt_sets.values()))[0]["prompt_ids"]
    context = calibration[0]["input_ids"][:COST_CONTEXT].tolist() if calibration else first[-COST_CONTEXT:]
    trees = tuple(cfg.eval.tree_budgets) if any(method(m).tree for m in cfg.eval.methods) else ()
    return cost_curve(target, drafter, context, block_size, trees, calibration, "calibration", cfg.eval.cost_repeats)


def cost_curve(target: Target, drafter: DFlashDrafter, context: list[int], block_size: int, trees: tuple[int, ...],
               calibration: list[dict], label: str, repeats: int) -> EvalContext:
    """measure_costs after a prefill of `context`, logged and wrapped as an EvalContext."""
    costs = measure_costs(target, drafter, context, block_size, repeats=repeats, tree_sizes=trees)
    log.info("%s: verify cost c(n) / c(1), n = 1..%d, at %d tokens of context: %s; draft %.2f; autoregressive "
             "step %.2f; 1-token step %.1f ms; trees of N nodes: %s", label, block_size, len(context),
             [round(c, 2) for c in costs["verify_cost"]], costs["draft_cost"], costs["ar_step_cost"],
             costs["step_ms"], {n: round(c, 2) for n, c in costs["tree_cost"].items()})
    return EvalContext.measured(costs, block_size, calibration)


def decode_context(prompts: list[dict], max_new_tokens: int, room: int) -> list[int]:
    """Tokens as many as the median context of these prompts' decodes (prompt plus half the reply), so a set's
    cost curve is measured where its decoding runs (attention grows with the context; turn-2 prompts are long)."""
    length = min(room, int(statistics.median(len(p["prompt_ids"]) + max_new_tokens // 2 for p in prompts)))
    ids = list(prompts[0]["prompt_ids"])
    return (ids * (length // len(ids) + 1))[:length]
