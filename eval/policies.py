"""Decoding policies: how a speculative round chooses its drafts and how many of them it verifies, on top of a
trained drafter (and, for MOBS/BMOBS, the pair selector). Each policy is an eval method (eval/protocol.py ChainMethod),
an entry of the method catalogue (eval/methods.py) under the component whose outputs it reads, and is reported
like every other method: exact against greedy decoding, with offline and online acceptance and speed.

  boltzmann  per position, argmax over the top-K of z/T_i + g: T_i = max(T exp(-m_i), 0.02 T) with m_i the top-1 /
             top-2 logit margin, g a Gumbel value hashed from (context, position, token) (no RNG state: reruns agree)
  mobs       middle-out selection with the pair selector: a centre anchor, then left and right, K scorings each
  bmobs      MOBS whose centre anchor is the Boltzmann pick
  act        margin-gated verify length: verify the leading drafts whose margin is at least a threshold
  adaptive   the verify length per round that maximises expected tokens per unit of measured cost, from running
             acceptance and the target's verify-cost curve; no draft at all while drafting does not pay

Calibration is bounded: a setting left None in eval.policy is chosen once per eval run from its grid (temperatures,
thresholds) on held-out teacher sequences kept apart from the eval prompts (EvalContext.calibration), and reported.
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field

import torch

from dflash_pipeline.eval.protocol import NOT_VERIFIED, ChainMethod, Proposal, RoundState, sync, \
    target_forward
from dflash_pipeline.eval.metrics import offline_metrics
from dflash_pipeline.eval.tree import DraftTree, verify_tree
from dflash_pipeline.models import cache as target_cache
from dflash_pipeline.models.selector import PairSelector

MIN_TEMPERATURE_FRACTION = 0.02  # T_i never drops below 2% of T (a huge margin would otherwise divide by ~0)


# -- what a policy sees once per eval run ------------------------------------------------------------------------
@dataclass
class EvalContext:
    """Measured once per eval run (eval/stage.py) and handed to every method's prepare()."""

    verify_cost: list[float]  # verify_cost[n - 1]: time to verify n tokens / time of a 1-token target step
    draft_cost: float  # one drafter block forward / a 1-token target step
    step_s: float  # seconds of a 1-token target step (the unit of the two above)
    block_size: int
    calibration: list[dict] = field(default_factory=list)  # teacher-forced items apart from the eval prompts
    tree_cost: dict[int, float] = field(default_factory=dict)  # N -> verifying a tree of N nodes / a 1-token step
    ar_cost: float = 1.0  # a plain autoregressive step (no features out) / a 1-token target step
    context_tokens: int = 0  # the context length the curve was measured at

    @classmethod
    def measured(cls, costs: dict, block_size: int, calibration: list[dict] | None = None) -> EvalContext:
        """From measure_costs' result."""
        return cls(costs["verify_cost"], costs["draft_cost"], costs["step_ms"] / 1e3, block_size,
                   list(calibration or []), costs["tree_cost"], costs["ar_step_cost"], costs["context_tokens"])

    def report(self) -> dict:
        """What eval_results.json records of the curve."""
        return {"verify_cost": self.verify_cost, "draft_cost": self.draft_cost, "ar_cost": self.ar_cost,
                "step_ms": self.step_s * 1e3, "context_tokens": self.context_tokens,
                "tree_cost": {str(n): c for n, c in self.tree_cost.items()}}

    def round_cost(self, verified: int, drafted: bool = True) -> float:
        """A round's cost in autoregressive steps: verify anchor + `verified` drafts (beyond the block: a tree of that
        many nodes, the nearest measured size at or above it), plus the draft when one was made, over ar_cost."""
        if verified < len(self.verify_cost):
            verify = self.verify_cost[verified]
        else:
            sizes = sorted(self.tree_cost)
            verify = self.tree_cost[next((n for n in sizes if n >= verified), sizes[-1])]
        return (verify + (self.draft_cost if drafted else 0.0)) / self.ar_cost


@torch.no_grad()
def measure_costs(target, drafter, context_ids: list[int], block_size: int, repeats: int = 9,
                  tree_sizes: tuple[int, ...] = (), rollback: str | None = None) -> dict:
    """The target's verify-cost curve c(n) = time(verify n tokens) / time(1 token), n = 1..B, after a prefill of
    `context_ids`, the drafter's block forward in the same unit, and for each N of tree_sizes the verification of
    an N-node tree (eval/tree.py verify_tree: ancestor mask, greedy walk, cache compaction). Repeats interleave every
    size (one warm-up pass first); each ratio is the median over passes of a time over the same pass's 1-token
    step, so a spell of a slower machine cancels out. Verification is timed as the eval loop runs it (hidden states
    out, cache rolled back after: a crop, or a recurrent target's rollback); ar_step_cost is a plain decoding step as
    autoregressive() runs it (no hidden states) in the same unit, the baseline a speedup is measured against."""

    model = target.model
    device = next(model.parameters()).device
    layer_ids = list(drafter.config.target_layer_ids)
    L = len(context_ids)
    cache, feats, rollback, at_context = _prefilled_target(target, context_ids, layer_ids, block_size, rollback)
    anchor = context_ids[-1]
    chain = _prefilled_chain(drafter, feats, anchor, L, block_size, device)
    times: dict[int, list[float]] = {n: [] for n in range(1, block_size + 1)}
    trees = _wide_trees(tree_sizes if not target_cache.is_recurrent(model) else (), anchor)  # none on recurrent ones
    tree_times: dict[int, list[float]] = {N: [] for N in trees}
    draft: list[float] = []
    ar_step: list[float] = []
    ids = torch.full((1, block_size), anchor, device=device)  # any tokens: only the time is kept

    def timed(into: list[float], r: int, run, crop: bool = True) -> None:
        """Time run() and, as the eval loop does after a round that accepts no draft, the rollback to the context
        and the anchor (a crop; a recurrent target's rollback: models/cache.py); then, untimed, back to the context.
        Pass 0 is the warm-up, not kept."""
        sync(device)
        t0 = time.perf_counter()
        if crop:
            rollback.before(cache)
        run()
        if crop and target_cache.seq_length(cache) > L + 1:
            rollback.after(cache, L + 1, ids[:, :1], torch.tensor([[L]], device=device))
        sync(device)
        if r:
            into.append(time.perf_counter() - t0)
        if crop:
            target_cache.restore(cache, at_context)

    for r in range(repeats + 1):
        # a plain decoding step as autoregressive() runs it: no hidden states out
        timed(ar_step, r, lambda: model(input_ids=ids[:, :1], position_ids=torch.tensor([[L]], device=device),
                                        cache=cache, use_cache=True))
        for n in range(1, block_size + 1):
            timed(times[n], r, lambda: target_forward(model, ids[:, :n], torch.arange(L, L + n, device=device)[None],
                                                      cache, layer_ids))
        for N, tree in trees.items():
            timed(tree_times[N], r, lambda: verify_tree(model, cache, L, anchor, tree, layer_ids))
        one = RoundState(feats[None, -1:], torch.tensor([L - 1 + r], device=device), anchor, L + r, [anchor])
        # one committed token enters the drafter's context, as in a round (no target cache to crop)
        timed(draft, r, lambda: chain.propose(one, block_size), crop=False)
    return _cost_ratios(times, draft, ar_step, tree_times, L, repeats)


def _prefilled_target(target, context_ids: list[int], layer_ids: list[int], block_size: int,
                      rollback: str | None) -> tuple:
    """The target's cache after a prefill of `context_ids`, with the tapped hidden states (feats), the rollback that
    takes a round back (its recording started) and a snapshot to restore the context from after each timing."""
    model = target.model
    device = next(model.parameters()).device
    cache = target_cache.new_cache(model)
    L = len(context_ids)
    _, feats, _ = target_forward(model, torch.tensor([context_ids], device=device),
                                 torch.arange(L, device=device)[None], cache, layer_ids, last_only=True)
    rollback = target_cache.Rollback(model, rollback or getattr(target, "rollback", "record"))
    rollback.start(cache, block_size)
    return cache, feats, rollback, target_cache.snapshot(cache)


def _prefilled_chain(drafter, feats: torch.Tensor, anchor: int, L: int, block_size: int, device) -> ChainMethod:
    """The drafter's chain method with the context's features prefilled (not timed): a timed draft then adds one
    committed token, as a round does."""
    chain = ChainMethod(drafter)
    chain.start()
    chain.propose(RoundState(feats[None, :-1], torch.arange(L - 1, device=device), anchor, L - 1, [anchor]),
                  block_size)
    return chain


def _wide_trees(tree_sizes, anchor: int) -> dict[int, DraftTree]:
    """An N-node tree per size to time: 8 children per node, breadth first (the shape of a wide draft tree), every
    node the anchor token (only the time is kept)."""
    trees = {}
    for N in tree_sizes:
        parents = torch.arange(N) // 8 - 1
        depths = torch.ones(N, dtype=torch.long)
        for i in range(N):
            depths[i] = 1 if parents[i] < 0 else depths[parents[i]] + 1
        trees[N] = DraftTree(torch.full((N,), anchor), parents, depths)
    return trees


def _cost_ratios(times: dict[int, list[float]], draft: list[float], ar_step: list[float],
                 tree_times: dict[int, list[float]], L: int, repeats: int) -> dict:
    """measure_costs' result from the kept passes' times: each a median ratio to the 1-token step (times[1])."""
    step = times[1]

    def ratio(ts: list[float]) -> float:  # per pass, against that pass's 1-token step: a slow spell cancels out
        return statistics.median(t / s for t, s in zip(ts, step))

    return {"verify_cost": [ratio(times[n]) for n in times], "draft_cost": ratio(draft),
            "step_ms": 1e3 * statistics.median(step), "context_tokens": L, "repeats": repeats,
            "ar_step_cost": ratio(ar_step), "tree_cost": {N: ratio(t) for N, t in tree_times.items()}}


def predicted_speedup(tau: float, verified_hist: list[int], ctx: EvalContext) -> float:
    """Tokens per round over the mean round cost in autoregressive steps (= the speedup over autoregressive
    decoding if nothing else cost time): tau / E[round_cost(v)]."""
    rounds = sum(verified_hist)
    cost = sum(n * ctx.round_cost(v) for v, n in enumerate(verified_hist)) / max(1, rounds)
    return tau / cost if cost else 0.0


# -- Boltzmann -----------------------------------------------------------------------------------------------------
_GOLDEN = 0x9E3779B97F4A7C15 % (1 << 62)  # spreads position indices over the hash's bits (fits int64)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 (two's complement wrap-around; logical shifts emulated by masking)."""
    x = x ^ ((x >> 30) & ((1 << 34) - 1))
    x = x * -4658895280553007687  # 0xbf58476d1ce4e5b9 as int64
    x = x ^ ((x >> 27) & ((1 << 37) - 1))
    x = x * -7723592293110705685  # 0x94d049bb133111eb as int64
    return x ^ ((x >> 31) & ((1 << 33) - 1))


def context_hash(context: torch.Tensor) -> torch.Tensor:
    """(N, C) token ids (-1 padding) -> (N,) int64: a hash of the committed context ending at the anchor."""
    h = torch.zeros(context.shape[0], dtype=torch.long, device=context.device)
    for c in range(context.shape[1]):
        h = _mix(h ^ (context[:, c].long() + 2))
    return h


def gumbel_noise(context: torch.Tensor, cand_ids: torch.Tensor) -> torch.Tensor:
    """Deterministic Gumbel(0, 1) values g (N, P, K) for each (context, drafted position, candidate token)."""
    N, P, K = cand_ids.shape
    h = context_hash(context)[:, None, None]
    pos = torch.arange(1, P + 1, device=cand_ids.device)[None, :, None]
    x = _mix(_mix(h ^ (pos * _GOLDEN)) ^ (cand_ids.long() + 1))
    u = (((x >> 11) & ((1 << 53) - 1)).double() + 0.5) / float(1 << 53)  # in (0, 1)
    return -torch.log(-torch.log(u)).float()


def boltzmann_scores(U: torch.Tensor, cand_ids: torch.Tensor, context: torch.Tensor, temperature: float) -> torch.Tensor:
    """z / T_i + g over the candidates (N, P, K), U sorted best first: a Gumbel-max draw from softmax(z / T_i), with
    T_i = max(T exp(-m_i), 0.02 T) colder where the drafter is sure (large top-1 / top-2 margin m_i)."""
    if temperature <= 0:
        raise ValueError(f"Boltzmann temperature must be > 0, got {temperature}")
    margin = (U[..., 0] - U[..., 1]).clamp(min=0) if U.shape[-1] > 1 else torch.zeros_like(U[..., 0])
    t_i = (temperature * torch.exp(-margin)).clamp(min=MIN_TEMPERATURE_FRACTION * temperature)
    return U.float() / t_i[..., None] + gumbel_noise(context, cand_ids)


def _context_or_anchor(context: torch.Tensor | None, anchors: torch.Tensor) -> torch.Tensor:
    return anchors[:, None] if context is None else context


class BoltzmannMethod(ChainMethod):
    """Training-free: each position draws its draft from its own top-K by a hashed Gumbel-max (boltzmann_scores)."""

    name = "boltzmann"
    greedy_only = True

    def __init__(self, drafter, policy):
        super().__init__(drafter)
        self.top_k = int(policy.top_k)
        self.grid = [float(t) for t in policy.temperatures]
        self.fixed = policy.temperature is not None
        self.temperature = float(policy.temperature) if self.fixed else self.grid[len(self.grid) // 2]

    def prepare(self, ctx: EvalContext) -> dict:
        return prepare_setting(self, "temperature", self.grid, self.fixed, ctx, by="tau_offline")

    def path(self, cand_ids, cand_logits, hidden, anchors, context=None):
        s = boltzmann_scores(cand_logits, cand_ids, _context_or_anchor(context, anchors), self.temperature)
        return cand_ids.gather(-1, s.argmax(-1, keepdim=True))[..., 0], cand_ids.shape[1] * cand_ids.shape[2]


def prepare_setting(method, attr: str, grid: list[float], fixed: bool, ctx: EvalContext, by: str) -> dict:
    """What a policy reports for one setting: the value eval.policy gave (fixed), or, when it was null and there are
    calibration sequences, the best of its grid by `by` with every grid value's score."""
    if fixed or not ctx.calibration:
        return {attr: getattr(method, attr), "calibrated": False}
    value, scores = calibrate(method, attr, grid, ctx, by)
    return {attr: value, "calibrated": True, f"grid_{by}": scores}


def calibrate(method, attr: str, grid: list[float], ctx: EvalContext, by: str) -> tuple[float, dict]:
    """Set method.<attr> to each grid value, measure it teacher-forced on the calibration sequences, keep the best
    by `by` ("tau_offline" or "predicted_speedup"); returns (best value, {value: score})."""
    scores = {}
    for value in grid:
        setattr(method, attr, value)
        m = offline_metrics(method.drafter, ctx.calibration, ctx.block_size, [1], methods={"m": method})["methods"]["m"]
        scores[value] = m["tau_offline"] if by == "tau_offline" else \
            predicted_speedup(m["tau_offline"], m["verified_hist"], ctx)
    best = max(grid, key=lambda v: (scores[v], -grid.index(v)))  # ties: the first grid value
    setattr(method, attr, best)
    return best, {str(k): round(v, 4) for k, v in scores.items()}


# -- MOBS / BMOBS --------------------------------------------------------------------------------------------------
def _pick(cand_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    return cand_ids.gather(-1, scores.argmax(-1, keepdim=True))[..., 0]


def middle_out(selector: PairSelector, cand_ids: torch.Tensor, U: torch.Tensor, hidden: torch.Tensor,
               anchors: torch.Tensor, refine: int = 0, centre_scores: torch.Tensor | None = None,
               ) -> tuple[torch.Tensor, int]:
    """Middle-out block selection: cand_ids / U (N, P, K) best first, hidden (N, P, H) the drafter's states at the
    drafted positions, anchors (N,). Returns drafts (N, P) and candidate scorings per block.

    The centre position c is picked first: P odd, the middle; P even, whichever of the two middles has the smaller
    top-1 / top-2 margin (the less certain one, where a wrong marginal pick is likeliest). Its pick maximises the
    pair score from its left neighbour (the anchor, or that neighbour's marginal argmax), or `centre_scores`
    (N, P, K) at c when given (BMOBS: the Boltzmann scores). Then right: S_t(chosen_{t-1}, b); left: U_t(a) +
    T_{t+1}(a, chosen_{t+1}) (+ T_0(anchor, a) at the first position): K scorings per position, O(P K). Each
    refinement pass re-picks every position given both chosen neighbours (2K scorings per position)."""
    N, P, K = cand_ids.shape
    if P == 1:
        centres = torch.zeros(N, dtype=torch.long, device=cand_ids.device)
    elif P % 2:
        centres = torch.full((N,), P // 2, dtype=torch.long, device=cand_ids.device)
    else:
        margin = U[..., 0] - U[..., 1] if K > 1 else torch.zeros_like(U[..., 0])
        lo, hi = P // 2 - 1, P // 2
        centres = torch.where(margin[:, lo] <= margin[:, hi], lo, hi)
    out = torch.empty(N, P, dtype=cand_ids.dtype, device=cand_ids.device)
    for c in centres.unique().tolist():
        rows = (centres == c).nonzero()[:, 0]
        out[rows] = _middle_out_rows(selector, cand_ids[rows], U[rows], hidden[rows], anchors[rows], c, refine,
                                     None if centre_scores is None else centre_scores[rows])
    return out, K * P + refine * 2 * K * P


def _middle_out_rows(sel, cand, U, hidden, anchors, c, refine, centre_scores):
    P = cand.shape[1]
    trans = sel.transition  # (hidden (.., H), prev (.., M), cand (.., K)) -> (.., M, K)
    chosen: list[torch.Tensor | None] = [None] * P
    if centre_scores is not None:
        chosen[c] = _pick(cand[:, c], centre_scores[:, c])
    else:
        left = anchors if c == 0 else cand[:, c - 1, 0]
        chosen[c] = _pick(cand[:, c], sel.scores(U[:, c], hidden[:, c], left[:, None], cand[:, c])[:, 0])
    for t in range(c + 1, P):
        chosen[t] = _pick(cand[:, t], sel.scores(U[:, t], hidden[:, t], chosen[t - 1][:, None], cand[:, t])[:, 0])
    for t in range(c - 1, -1, -1):
        chosen[t] = _pick(cand[:, t], _both_sides(trans, cand, U, hidden, anchors, chosen, t, left_known=t == 0))
    for _ in range(refine):
        for t in range(P):
            chosen[t] = _pick(cand[:, t], _both_sides(trans, cand, U, hidden, anchors, chosen, t, left_known=True))
    return torch.stack(chosen, 1)


def _both_sides(trans, cand, U, hidden, anchors, chosen, t, left_known):
    """U_t(b) + T_t(left, b) (when the left token is known) + T_{t+1}(b, right) (when there is a right token)."""
    s = U[:, t].float()
    if left_known:
        left = anchors if t == 0 else chosen[t - 1]
        s = s + trans(hidden[:, t], left[:, None], cand[:, t])[:, 0].float()
    if t + 1 < cand.shape[1] and chosen[t + 1] is not None:
        s = s + trans(hidden[:, t + 1], cand[:, t], chosen[t + 1][:, None])[..., 0].float()
    return s


class MiddleOutMethod(ChainMethod):
    """MOBS (middle-out block selection) with the trained pair selector; `boltzmann` picks the centre by the
    Boltzmann rule first (BMOBS)."""

    greedy_only = True

    def __init__(self, drafter, selector: PairSelector, policy, boltzmann: bool = False):
        super().__init__(drafter)
        self.selector, self.refine, self.top_k = selector, int(policy.refine), selector.top_k
        self.name = "bmobs" if boltzmann else "mobs"
        self.boltzmann = BoltzmannMethod(drafter, policy) if boltzmann else None

    def prepare(self, ctx: EvalContext) -> dict:
        if self.boltzmann is None:
            return {"refine": self.refine}
        b = self.boltzmann
        return {"refine": self.refine, **prepare_setting(self, "temperature", b.grid, b.fixed, ctx, by="tau_offline")}

    @property
    def temperature(self) -> float:
        return self.boltzmann.temperature

    @temperature.setter
    def temperature(self, value: float) -> None:
        self.boltzmann.temperature = value

    def path(self, cand_ids, cand_logits, hidden, anchors, context=None):
        centre = None
        if self.boltzmann is not None:
            centre = boltzmann_scores(cand_logits, cand_ids, _context_or_anchor(context, anchors),
                                      self.boltzmann.temperature)
        return middle_out(self.selector, cand_ids, cand_logits, hidden[:, 1:].float(), anchors, self.refine, centre)


# -- ACT: margin-gated verify length ------------------------------------------------------------------------------
def gated_length(U: torch.Tensor, threshold: float) -> torch.Tensor:
    """(N, P, >=2) logits best first -> (N,) the number of leading positions whose top-1 / top-2 margin is at least
    `threshold` (threshold 0: every position)."""
    if threshold < 0:
        raise ValueError(f"ACT threshold must be >= 0, got {threshold}")
    sure = (U[..., 0] - U[..., 1]) >= threshold
    return sure.long().cumprod(-1).sum(-1)


class ActMethod(ChainMethod):
    """The drafter's argmax path, verified only up to the first position whose margin is below the threshold."""

    greedy_only = True

    name = "act"
    top_k = 2

    def __init__(self, drafter, policy):
        super().__init__(drafter)
        self.grid = [float(t) for t in policy.thresholds]
        self.fixed = policy.threshold is not None
        self.threshold = float(policy.threshold) if self.fixed else 0.0

    def prepare(self, ctx: EvalContext) -> dict:
        return prepare_setting(self, "threshold", self.grid, self.fixed, ctx, by="predicted_speedup")

    def path(self, cand_ids, cand_logits, hidden, anchors, context=None):
        drafts = cand_ids[..., 0].clone()
        keep = gated_length(cand_logits, self.threshold)
        drafts[torch.arange(drafts.shape[1], device=drafts.device)[None] >= keep[:, None]] = NOT_VERIFIED
        return drafts, 0


# -- adaptive block ---------------------------------------------------------------------------------------------
def best_length(acceptance: list[float], ctx: EvalContext, least: int = 0) -> tuple[int, float]:
    """The number of drafts v >= least (v = 0: no draft at all) maximising expected tokens per round over the
    round's cost in autoregressive steps, (1 + sum_{k<=v} prod_{j<=k} a_j) / round_cost(v). Returns (v, that
    ratio)."""
    best, best_ratio, reach, tokens = 0, 1.0 / ctx.round_cost(0, drafted=False), 1.0, 1.0
    if least > 0:
        best, best_ratio = least, -math.inf
    for v in range(1, len(acceptance) + 1):
        reach *= acceptance[v - 1]
        tokens += reach
        ratio = tokens / ctx.round_cost(v)
        if v >= least and ratio > best_ratio:
            best, best_ratio = v, ratio
    return best, best_ratio


class AdaptiveMethod(ChainMethod):
    """The verify length of each round from running per-position acceptance and the measured cost curve
    (best_length). When no length pays, rounds skip the drafter entirely (one target step each, as autoregressive
    decoding) and only every `probe_every`-th round drafts to refresh the estimates, so a useless drafter costs little
    over autoregressive decoding. policy.adaptive=False keeps the fixed block (the plain chain)."""

    greedy_only = True

    name = "adaptive"

    def __init__(self, drafter, policy):
        super().__init__(drafter)
        self.enabled, self.probe_every, self.memory = bool(policy.adaptive), int(policy.probe_every), \
            float(policy.memory)
        self.ctx: EvalContext | None = None
        self.prior: list[float] | None = None

    def prepare(self, ctx: EvalContext) -> dict:
        """The cost curve, and a prior acceptance: the chain's a_k on the calibration sequences (0.5 without)."""
        self.ctx = ctx
        P = ctx.block_size - 1
        self.prior = [0.5] * P
        if ctx.calibration:
            self.prior = offline_metrics(self.drafter, ctx.calibration, ctx.block_size, [1])["a_k"]
        v, ratio = best_length(self.prior, ctx)
        return {"adaptive": self.enabled, "prior_a_k": [round(a, 4) for a in self.prior], "prior_length": v,
                "prior_predicted_speedup": round(ratio, 4), "probe_every": self.probe_every}

    def start(self) -> None:
        super().start()
        self.acceptance = list(self.prior or [0.5] * (self.max_block_size - 1))
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.last: tuple[int, int] | None = None  # (anchor position, drafts verified) of the previous drafted round
        self.skipped = 0

    def _learn(self, anchor_pos: int) -> None:
        """The previous round accepted n = (anchor_pos - its anchor_pos - 1) of its v drafts: update a_1 .. a_v."""
        if self.last is None:
            return
        pos, v = self.last
        n, m = anchor_pos - pos - 1, self.memory
        for k in range(1, v + 1):
            if n < k - 1:
                break
            self.acceptance[k - 1] = m * self.acceptance[k - 1] + (1 - m) * float(n >= k)
        self.last = None

    def propose(self, state: RoundState, block_size: int, temperature: float = 0.0,
                generator: torch.Generator | None = None) -> Proposal:
        if not self.enabled or self.ctx is None:
            return super().propose(state, block_size, temperature, generator)
        self._learn(state.anchor_pos)
        v, _ = best_length(self.acceptance[: block_size - 1], self.ctx)
        if v == 0:
            self.skipped += 1
            if self.skipped < self.probe_every:  # no draft: keep the committed features for the next drafter call
                self.pending.append((state.new_features, state.new_positions))
                return Proposal(state.new_positions.new_zeros(0), drafted=False)
            v, _ = best_length(self.acceptance[: block_size - 1], self.ctx, least=1)  # a probe
        self.skipped = 0
        if self.pending:
            feats = torch.cat([f for f, _ in self.pending] + [state.new_features], dim=1)
            positions = torch.cat([p for _, p in self.pending] + [state.new_positions])
            state = RoundState(feats, positions, state.anchor, state.anchor_pos, state.output, state.context,
                               state.verifier_hidden)
            self.pending = []
        prop = super().propose(state, block_size, temperature, generator)
        prop.tokens = prop.tokens[:v]
        self.last = (state.anchor_pos, len(prop.tokens))
        return prop

