"""Benchmark: per-process memory of training a drafter shaped for a large target, 1 process against N under FSDP.

    python scripts/bench_fsdp_memory.py [--shape llama70b|qwen3_8b] [--layers 1] [--processes 1 2] [--threads 1]

For each process count, launches the training path of an FSDP launch (`accelerate launch --config_file
scripts/accelerate/cpu_2proc_fsdp.yaml --num_processes N`, train/parallel.py `Sharded`) on a DFlash drafter with the
target's width, heads and MLP (random weights; --layers of them: a 70B-class drafter of 5 layers does not fit this
machine's memory once, so fewer layers measure the same per-layer sharding, and the table scales the state bytes to
5 layers as an estimate), runs 2 AdamW steps on random features (block 16, 64 context tokens) and reports per rank:
the bytes of parameters, gradients and AdamW state it holds (exact, from the local shards), the peak resident memory
of the process (max RSS), and rank 0's unsharded replica for eval and export (host memory). The target's frozen
embedding and LM head are whole on every rank in every setting; they are built with a 4,096-token vocabulary here
(not part of the comparison) and counted in neither column.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

SHAPES = {  # hidden, MLP, heads, KV heads, head dim, target layers, taps
    "llama70b": (8192, 28672, 64, 8, 128, 80, 5),
    "qwen3_8b": (4096, 12288, 32, 8, 128, 36, 5),
}
ROOT = Path(__file__).resolve().parents[1]


def child(shape: str, layers: int, out: Path) -> None:
    """One rank of the FSDP launch: build, shard, train 2 steps, write this rank's figures."""
    from accelerate import Accelerator

    from dflash_pipeline.models.drafter import DFlashDrafter, DFlashDrafterConfig
    from dflash_pipeline.models.families import default_layer_ids
    from dflash_pipeline.train.parallel import Sharded

    H, I, heads, kv, hd, L, taps = SHAPES[shape]
    V = 4096
    acc = Accelerator(cpu=True)
    torch.manual_seed(0)
    config = DFlashDrafterConfig(hidden_size=H, intermediate_size=I, num_hidden_layers=layers,
                                 num_attention_heads=heads, num_key_value_heads=kv, head_dim=hd, rms_norm_eps=1e-5,
                                 rope_theta=5e5, max_position_embeddings=4096, vocab_size=V, block_size=16,
                                 target_hidden_size=H, target_layer_ids=default_layer_ids(L, taps),
                                 num_target_layers=L, mask_token_id=V - 1)
    embed, head = torch.nn.Embedding(V, H), torch.nn.Linear(H, V, bias=False)
    for p in (*embed.parameters(), *head.parameters()):
        p.requires_grad_(False)
    drafter = DFlashDrafter(config, embed, head)
    trainable = sum(p.numel() for p in drafter.parameters() if p.requires_grad)

    def make(params):
        opt = torch.optim.AdamW(params, lr=1e-4)
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)

    par = Sharded(drafter, make, acc, sharded=True)
    Tc, Nb, B = 64, 2, 16
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        features = torch.randn(1, Tc, taps * H, generator=g)
        block_ids = torch.randint(0, V - 1, (1, Nb, B), generator=g)
        anchor_pos = torch.tensor([[16, 40]])
        hidden = par.model(features, block_ids, anchor_pos)
        loss = par.model.logits(hidden[..., 1:, :]).float().logsumexp(-1).mean()
        loss.backward()
        par.optimizer.step()
        par.optimizer.zero_grad(set_to_none=False)

    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    held = 0
    for p in par.model.parameters():
        if p.requires_grad:
            held += local(p).numel() * p.element_size() + (local(p.grad).numel() * p.grad.element_size())
            held += sum(local(v).numel() * v.element_size() for v in par.optimizer.state[p].values()
                        if torch.is_tensor(v) and v.dim() > 0)
    replica = sum(p.numel() * p.element_size() for p in par.replica.parameters()) if par.replica is not None else 0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    (out / f"rank{acc.process_index}.json").write_text(json.dumps(
        {"trainable": trainable, "state_bytes": held, "max_rss": rss, "replica_bytes": replica}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama70b")
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--processes", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.shape, args.layers, Path(args.child))
        return
    gib = 1024 ** 3
    rows = []
    for n in args.processes:
        with tempfile.TemporaryDirectory() as tmp:
            env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
            subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                            str(ROOT / "scripts" / "accelerate" / "cpu_2proc_fsdp.yaml"), "--num_processes", str(n),
                            __file__, "--shape", args.shape, "--layers", str(args.layers), "--child", tmp],
                           check=True, env=env)
            ranks = [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(n)]
        rows.append((n, ranks))
    trainable = rows[0][1][0]["trainable"]
    H, I, heads, kv, hd, L, taps = SHAPES[args.shape]
    print(f"{args.shape}-shaped drafter (hidden {H}, MLP {I}, {heads} heads / {kv} KV, {taps} taps): {args.layers} "
          f"layer(s), {trainable / 1e9:.2f}B trainable parameters; AdamW, float32 weights")
    print("| processes | params + grads + AdamW per rank (GiB) | peak RSS rank 0 / others (GiB) | "
          "rank-0 replica (GiB) | state per rank scaled to 5 layers (GiB, estimate) |")
    print("|---|---|---|---|---|")
    for n, ranks in rows:
        state = max(r["state_bytes"] for r in ranks)
        rss = f"{ranks[0]['max_rss'] / gib:.2f}" + (f" / {max(r['max_rss'] for r in ranks[1:]) / gib:.2f}"
                                                     if n > 1 else "")
        scale = 16 * trainable_at(args.shape, 5) / n
        print(f"| {n} | {state / gib:.2f} | {rss} | {ranks[0]['replica_bytes'] / gib:.2f} | "
              f"{scale / gib:.1f} |")
    base = max(r["state_bytes"] for r in rows[0][1])
    for n, ranks in rows[1:]:
        print(f"state per rank, {n} processes / 1: {max(r['state_bytes'] for r in ranks) / base:.3f}")


def trainable_at(shape: str, layers: int) -> int:
    """Trainable parameters of the drafter of this shape with `layers` layers (fc + hidden_norm + layers + norm)."""
    H, I, heads, kv, hd, L, taps = SHAPES[shape]
    layer = H * heads * hd * 2 + H * kv * hd * 2 + 3 * H * I + 2 * H + 2 * hd
    return taps * H * H + H + layers * layer + H


if __name__ == "__main__":
    main()
