"""The Weaver adapter ("Trees from Marginals"): conditions the block drafter's per-depth marginals on the tokens
already chosen along a tree path, over a small candidate pool per depth, so a draft tree can branch where the
drafter is unsure and still stay consistent along each branch.

A small causal transformer over two kinds of tokens (width d = `rank`):
- the prefix, computed once per round: proposal_in(norm(verifier final hidden of the row that produced the anchor)),
  then proposal_in(norm(drafter hidden at depth t)) for t = 1 .. B-1. RoPE positions 0 .. B-1, causal among
  themselves;
- tree nodes: token_in(norm(E[token])) with E the target's input embeddings; a node at depth t (the anchor is depth 0)
  sits at RoPE position t + 1, the position of the drafter state of the depth it scores, and attends to the whole
  prefix, its ancestors and itself.
Blocks: pre-norm RMSNorm, fused QKV, RoPE (base 1e4), SwiGLU.

Output of a node at depth t, over the pool of depth t + 1 (the drafter's top-K there, target ids c):

    logit(c) = drafter logit(c) + < W_lm[c], Q out_norm(x) >,   log-softmax over the pool

W_lm: the target's LM-head rows of the candidates (frozen), Q: `query` (rank -> H). Nothing projects onto the full
vocabulary: a node reads only its pool's K rows of W_lm. `query` starts at zero, so an untrained Weaver scores
exactly as the drafter's marginals.

Shapes: N rows (blocks or rounds), B block size, H target/drafter hidden, T nodes, M earlier nodes (memory),
K pool size per depth, d = rank.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.qwen3.configuration_qwen3 import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, rotate_half

# The Weaver's tensors in a component export are named under this prefix (docs/export.md).
WEAVER_PREFIX = "weaver."

ROPE_BASE = 10_000.0


def rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """RoPE on x (N, h, T, D) at integer positions (N, T), frequencies in float32."""
    D = x.shape[-1]
    inv_freq = ROPE_BASE ** (-torch.arange(0, D, 2, device=x.device, dtype=torch.float32) / D)
    angles = positions.float()[..., None] * inv_freq  # (N, T, D/2)
    cos, sin = torch.cat([angles.cos()] * 2, -1)[:, None], torch.cat([angles.sin()] * 2, -1)[:, None]
    return (x.float() * cos + rotate_half(x.float()) * sin).to(x.dtype)


class WeaverBlock(nn.Module):
    def __init__(self, rank: int, num_heads: int, mlp_dim: int, eps: float):
        super().__init__()
        if rank % num_heads or (rank // num_heads) % 2:
            raise ValueError(f"weaver.num_heads {num_heads} must divide weaver.rank {rank} into even head sizes")
        self.num_heads, self.head_dim = num_heads, rank // num_heads
        self.attn_norm = Qwen3RMSNorm(rank, eps)
        self.qkv = nn.Linear(rank, 3 * rank, bias=False)
        self.o_proj = nn.Linear(rank, rank, bias=False)
        self.mlp_norm = Qwen3RMSNorm(rank, eps)
        self.mlp = Qwen3MLP(Qwen3Config(hidden_size=rank, intermediate_size=mlp_dim, hidden_act="silu"))

    def forward(self, x: torch.Tensor, positions: torch.Tensor, past: tuple[torch.Tensor, torch.Tensor] | None,
                mask: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """x (N, T, d) at positions (N, T); past K/V (N, h, S, Dh) or None; mask (N, T, S + T) bool, True = may
        attend. Returns the new x and the new tokens' own K/V (N, h, T, Dh)."""
        N, T, d = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(N, T, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k = rope(q, positions), rope(k, positions)
        keys, values = (k, v) if past is None else (torch.cat([past[0], k], 2), torch.cat([past[1], v], 2))
        y = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask[:, None])
        x = x + self.o_proj(y.transpose(1, 2).reshape(N, T, d))
        return x + self.mlp(self.mlp_norm(x)), (k, v)


class Weaver(nn.Module):
    """The adapter's weights; `config_dict()` / `Weaver(**config)` round-trip it (the export's dflash_config)."""

    def __init__(self, hidden_size: int, rank: int = 256, num_layers: int = 2, num_heads: int = 4,
                 mlp_dim: int = 512, top_k: int = 512, eps: float = 1e-6):
        super().__init__()
        self.hidden_size, self.rank, self.num_layers = hidden_size, rank, num_layers
        self.num_heads, self.mlp_dim, self.top_k, self.eps = num_heads, mlp_dim, top_k, eps
        self.proposal_norm = Qwen3RMSNorm(hidden_size, eps)
        self.proposal_in = nn.Linear(hidden_size, rank)
        self.embed_norm = Qwen3RMSNorm(hidden_size, eps)
        self.token_in = nn.Linear(hidden_size, rank)
        self.blocks = nn.ModuleList(WeaverBlock(rank, num_heads, mlp_dim, eps) for _ in range(num_layers))
        self.out_norm = Qwen3RMSNorm(rank, eps)
        self.query = nn.Linear(rank, hidden_size, bias=False)
        nn.init.zeros_(self.query.weight)

    def config_dict(self) -> dict:
        return {"hidden_size": self.hidden_size, "rank": self.rank, "num_layers": self.num_layers,
                "num_heads": self.num_heads, "mlp_dim": self.mlp_dim, "top_k": self.top_k, "eps": self.eps}

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    # ---- the two kinds of tokens ----

    def prefix(self, verifier_hidden: torch.Tensor, drafter_hidden: torch.Tensor) -> list[tuple]:
        """The round's prefix K/V per block: verifier_hidden (N, H) the target's final hidden state of the row that
        produced the anchor; drafter_hidden (N, B-1, H) the drafter's states at depths 1 .. B-1."""
        feats = torch.cat([verifier_hidden[:, None], drafter_hidden], 1).to(self.proposal_in.weight.dtype)
        x = self.proposal_in(self.proposal_norm(feats))  # (N, B, d)
        N, P, _ = x.shape
        positions = torch.arange(P, device=x.device).expand(N, P)
        mask = torch.ones(P, P, dtype=torch.bool, device=x.device).tril().expand(N, P, P)
        kv = []
        for block in self.blocks:
            x, own = block(x, positions, None, mask)
            kv.append(own)
        return kv

    def nodes(self, embeddings: torch.Tensor, depths: torch.Tensor, prefix_kv: list[tuple],
              memory_kv: list[tuple] | None, mask: torch.Tensor) -> tuple[torch.Tensor, list[tuple]]:
        """Run tree nodes: embeddings (N, T, H) the target's input embeddings of their tokens, depths (N, T);
        memory_kv: K/V per block of M earlier nodes (their ancestors among them) or None; mask (N, T, M + T) which
        earlier and new nodes each one sees (the prefix is always seen). Returns out_norm(x) (N, T, d) and the
        nodes' own K/V per block (to become memory)."""
        x = self.token_in(self.embed_norm(embeddings.to(self.token_in.weight.dtype)))
        N, T, _ = x.shape
        P = prefix_kv[0][0].shape[2]
        full = torch.cat([mask.new_ones(N, T, P), mask], -1)
        own = []
        for i, block in enumerate(self.blocks):
            past = prefix_kv[i] if memory_kv is None else tuple(torch.cat([p, m], 2)
                                                                for p, m in zip(prefix_kv[i], memory_kv[i]))
            x, kv = block(x, depths + 1, past, full)
            own.append(kv)
        return self.out_norm(x), own

    # ---- scores over the pool ----

    def log_probs(self, out: torch.Tensor, pool_logits: torch.Tensor, lm_rows: torch.Tensor) -> torch.Tensor:
        """Log-probabilities over each node's pool: out (..., d) = out_norm(x), pool_logits (..., K) the drafter's
        logits of the pool, lm_rows (..., K, H) the target's LM-head rows of the pool, or (K, H) when every node
        shares one pool. The residual is
        W_lm[c] . (Q out): K x H + H x d per node, which on a CPU beats projecting the pool through Q once per round
        (K x H x d per depth) at the node counts of a tree."""
        q = self.query(out)
        if lm_rows.dim() == 2:  # one pool for every node (a tree depth): one matmul, not a batched broadcast
            residual = q @ lm_rows.to(q.dtype).T
        else:
            residual = (lm_rows.to(q.dtype) @ q.unsqueeze(-1)).squeeze(-1)
        return torch.log_softmax(pool_logits.float() + residual.float(), -1)

    def chain_log_probs(self, verifier_hidden: torch.Tensor, drafter_hidden: torch.Tensor, embeddings: torch.Tensor,
                        pool_logits: torch.Tensor, lm_rows: torch.Tensor) -> torch.Tensor:
        """Teacher forcing along one path per block (training, offline metrics): embeddings (N, B-1, H) of [anchor,
        path tokens at depths 1 .. B-2]; pool_logits (N, B-1, K) and lm_rows (N, B-1, K, H) of the pools at depths
        1 .. B-1. Returns (N, B-1, K): the pool's log-probs at depth t+1 given the path up to depth t."""
        N, T, _ = embeddings.shape
        kv = self.prefix(verifier_hidden, drafter_hidden)
        depths = torch.arange(T, device=embeddings.device).expand(N, T)
        causal = torch.ones(T, T, dtype=torch.bool, device=embeddings.device).tril().expand(N, T, T)
        out, _ = self.nodes(embeddings, depths, kv, None, causal)
        return self.log_probs(out, pool_logits, lm_rows)


def weaver_loss(log_probs: torch.Tensor, pool_ids: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor,
                target_ids: torch.Tensor | None = None, target_logprobs: torch.Tensor | None = None,
                kl_weight: float = 0.0, tv_weight: float = 0.0) -> tuple[torch.Tensor, dict]:
    """(loss SUM over positions, stats). CE on the true token where it is in the pool; with the target's top-k
    log-probs (target_ids / target_logprobs (N, P, k)), plus kl_weight x KL(p || q) and tv_weight x TV(p, q), p the
    target's distribution restricted to the pool and renormalised, q the Weaver's.
    log_probs (N, P, K) over pool_ids (N, P, K); labels, valid (N, P)."""
    hit = pool_ids == labels[..., None]  # (N, P, K)
    in_pool = valid & hit.any(-1)
    ce = -(log_probs * hit).sum(-1)
    loss = (ce * in_pool).sum()
    correct = hit.gather(-1, log_probs.argmax(-1, keepdim=True)).squeeze(-1) & in_pool
    stats = {"positions": valid.sum(), "in_pool": in_pool.sum(), "ce_sum": (ce * in_pool).sum().detach(),
             "correct": correct.sum()}
    if target_ids is not None and (kl_weight or tv_weight):
        match = pool_ids[..., :, None] == target_ids[..., None, :]  # (N, P, K, k)
        p = (match * target_logprobs.float().exp()[..., None, :]).sum(-1)  # (N, P, K) target mass on the pool
        mass = p.sum(-1, keepdim=True)
        usable = valid & (mass.squeeze(-1) > 0)
        p = p / mass.clamp(min=1e-12)
        q = log_probs.exp()
        kl = (p * (p.clamp(min=1e-12).log() - log_probs)).sum(-1)
        tv = 0.5 * (p - q).abs().sum(-1)
        loss = loss + ((kl_weight * kl + tv_weight * tv) * usable).sum()
        stats["kl_sum"] = (kl * usable).sum().detach()
    return loss, stats


class WeaverRound:
    """One round's tree expansion: the prefix K/V and the pools' projected rows are computed once; `expand` runs a
    batch of nodes in ONE Weaver call and keeps their K/V as memory for their descendants.

    verifier_hidden (H,), drafter_hidden (B-1, H), pool_ids / pool_logits (B-1, K) the drafter's top-K target ids
    and logits at depths 1 .. B-1, lm_weight (V, H) the target's LM head (only pool rows are read), embed the
    target's input embeddings, anchor the root's token.
    """

    def __init__(self, weaver: Weaver, verifier_hidden: torch.Tensor, drafter_hidden: torch.Tensor,
                 pool_ids: torch.Tensor, pool_logits: torch.Tensor, lm_weight: torch.Tensor, embed: nn.Module,
                 anchor: int):
        self.weaver, self.embed, self.anchor, self.lm_weight = weaver, embed, anchor, lm_weight
        self.pool_ids, self.pool_logits = pool_ids, pool_logits
        self.prefix_kv = weaver.prefix(verifier_hidden[None], drafter_hidden[None])
        self.lm_rows: dict[int, torch.Tensor] = {}  # depth row -> the pool's LM-head rows (K, H), when first used
        self.memory: list[tuple] | None = None  # per block: K/V (1, h, M, Dh) of the expanded nodes
        self.ancestors: dict[int, list[int]] = {}  # node -> memory rows of its ancestors and itself
        self.calls: list[int] = []  # nodes per Weaver call

    @torch.no_grad()
    def expand(self, nodes: list[int], tokens: list[int], parents: list[int], depths: list[int],
               children: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Nodes (index -1 = the root, whose token is the anchor and depth 0) with their tokens, parents and
        depths (< B-1), all parents expanded earlier -> their best `children` candidates at the next depth: target
        ids and log-probs (w, children), best first."""
        device = self.pool_ids.device
        w = len(nodes)
        M = 0 if self.memory is None else self.memory[0][0].shape[2]
        rows, cols = [], []  # the (node, memory row) pairs it sees: its ancestors' and its own
        for i, (node, parent) in enumerate(zip(nodes, parents)):
            seen = ([] if node == -1 else self.ancestors[parent]) + [M + i]
            self.ancestors[node] = seen
            rows += [i] * len(seen)
            cols += seen
        mask = torch.zeros(1, w, M + w, dtype=torch.bool, device=device)
        mask[0, rows, cols] = True
        ids = torch.tensor([tokens], device=device)
        depth = torch.tensor([depths], device=device)
        out, own = self.weaver.nodes(self.embed(ids), depth, self.prefix_kv, self.memory, mask)
        self.memory = own if self.memory is None else [tuple(torch.cat([m, o], 2) for m, o in zip(mem, kv))
                                                       for mem, kv in zip(self.memory, own)]
        self.calls.append(w)
        rows = depth[0]  # a node at depth t scores the pool of depth t + 1, row t
        logp = torch.empty(w, self.pool_ids.shape[-1], device=device)
        for t in rows.unique().tolist():  # one matmul per depth over the pool's rows, no copy per node
            if t not in self.lm_rows:
                self.lm_rows[t] = self.lm_weight.index_select(0, self.pool_ids[t])
            at = rows == t
            logp[at] = self.weaver.log_probs(out[0, at], self.pool_logits[t], self.lm_rows[t]).float()
        best = logp.topk(min(children, logp.shape[-1]), -1)
        return self.pool_ids[rows].gather(-1, best.indices), best.values
