"""Benchmark: peak memory and time of one drafter training step per (shape, tokens, anchors), before and after the
memory savers, side by side in one run.

    python scripts/bench_memory.py [--shape smollm2 qwen3_8b] [--cases 2048x256 8192x512 smollm2:32768x1024]
                                   [--paths before after] [--limit-gb 18] [--threads 2]
                                   [--layers 1] [--json rows.json]

A case is TOKENSxANCHORS for every --shape, or SHAPE:TOKENSxANCHORS for one.

One step is what the training loop runs for the drafter (train/drafter.py DrafterComponent.loss, then backward):
`DFlashDrafter.forward_packed` over one sequence of T tokens with A anchor blocks (block 16), the target's LM head
over the full vocabulary, the decay loss, backward; float32 unless the path says bf16 (autocast, as
`trainer.mixed_precision=bf16`), no optimizer state. The drafter is --layers layers (default one) shaped for the target (random weights;
its embedding and LM head frozen, as the target's are), with 5 tapped layers. Paths:

- before: the whole logits and the whole packed mask at once (trainer.logits_chunk_mb=0, drafter.attention_chunk_mb=0)
- after: logits and losses in slices of trainer.logits_chunk_mb, the mask in slices of drafter.attention_chunk_mb
  (the defaults), each recomputed in the backward
- after+ckpt: after, with trainer.activation_checkpointing=true
- after+ckpt+bf16: and bf16 autocast

Each case runs in a process of its own. "Above the weights" is the peak resident memory of the step minus the
resident memory of the built model (peak reset by /proc/self/clear_refs between the two); a case that needs more than
--limit-gb above the weights stops with "does not fit" (address-space limit) instead of taking the machine down.
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

SHAPES = {  # hidden, MLP, heads, KV heads, head dim, vocabulary, target layers
    "smollm2": (576, 1536, 9, 3, 64, 49152, 30),
    "qwen3_8b": (4096, 12288, 32, 8, 128, 151936, 36),
}
PATHS = {  # trainer.logits_chunk_mb, drafter.attention_chunk_mb, activation checkpointing, bf16 autocast
    "before": (0.0, 0.0, False, False),
    "after": (256.0, 64.0, False, False),
    "after+ckpt": (256.0, 64.0, True, False),
    "after+ckpt+bf16": (256.0, 64.0, True, True),
}
BLOCK = 16


def status_gb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024 / 1e9
    raise RuntimeError(f"no {field} in /proc/self/status")


def child(shape: str, tokens: int, anchors: int, path: str, limit_gb: float, threads: int, layers: int = 1) -> dict:
    """Build, then one step; returns the figures of this case."""
    import torch
    from omegaconf import OmegaConf

    from dflash_pipeline.models.drafter import DFlashDrafter, DFlashDrafterConfig
    from dflash_pipeline.models.families import default_layer_ids
    from dflash_pipeline.train.drafter import DrafterComponent
    from dflash_pipeline.train.losses import default_gamma

    torch.set_num_threads(threads)
    H, I, heads, kv, hd, V, L = SHAPES[shape]
    logits_mb, attention_mb, ckpt, bf16 = PATHS[path]
    torch.manual_seed(0)
    config = DFlashDrafterConfig(hidden_size=H, intermediate_size=I, num_hidden_layers=layers, num_attention_heads=heads,
                                 num_key_value_heads=kv, head_dim=hd, rms_norm_eps=1e-6, rope_theta=1e6,
                                 max_position_embeddings=65536, vocab_size=V, block_size=BLOCK, target_hidden_size=H,
                                 target_layer_ids=default_layer_ids(L, 5), num_target_layers=L, mask_token_id=V - 1,
                                 attention_chunk_mb=attention_mb)
    embed, head = torch.nn.Embedding(V, H), torch.nn.Linear(H, V, bias=False)
    with torch.no_grad():
        embed.weight.normal_(0, 0.02)
        head.weight.normal_(0, 0.02)
    drafter = DFlashDrafter(config, embed, head).train()
    drafter.activation_checkpointing = ckpt
    # the drafter component's loss path itself, without a teacher dataset: the fields DrafterComponent.loss reads
    comp = DrafterComponent.__new__(DrafterComponent)
    comp.cfg = OmegaConf.create({"trainer": {"loss": "decay", "logits_chunk_mb": logits_mb, "dpace_alpha": 0.5}})
    comp.device, comp.gamma, comp.block_size = torch.device("cpu"), default_gamma(BLOCK), BLOCK
    comp.to_column, comp.model_columns, comp.selector_weight = torch.arange(V), V, 0.0
    weights_gb = sum(t.numel() * t.element_size() for t in (*drafter.parameters(), embed.weight, head.weight)) / 1e9

    gen = torch.Generator().manual_seed(0)
    prompt = min(64, tokens // 4)
    anchor_pos = torch.randperm(tokens - prompt - 1, generator=gen)[:anchors].sort().values + prompt
    ids = torch.randint(0, V - 1, (tokens,), generator=gen)
    block_ids = torch.full((1, anchors, BLOCK), V - 1)
    block_ids[0, :, 0] = ids[anchor_pos]
    pos = (anchor_pos[:, None] + torch.arange(1, BLOCK)).clamp(max=tokens - 1)
    batch = {"features": torch.randn(1, tokens, 5 * H, generator=gen).to(torch.bfloat16),  # as the teacher stores them
             "context_valid": torch.ones(1, tokens, dtype=torch.bool), "block_ids": block_ids,
             "anchor_pos": anchor_pos[None], "anchor_valid": torch.ones(1, anchors, dtype=torch.bool),
             "labels": ids[pos][None], "label_valid": (anchor_pos[:, None] + torch.arange(1, BLOCK) < tokens)[None]}

    built = status_gb("VmRSS")
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (int((status_gb("VmSize") + limit_gb) * 1e9), hard))
    Path("/proc/self/clear_refs").write_text("5")  # peak RSS from here
    start = time.perf_counter()
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss, _ = comp.loss(drafter, batch)
        loss.backward()
    except (RuntimeError, MemoryError) as e:
        if "memory" not in str(e).lower() and not isinstance(e, MemoryError):
            raise
        return {"fits": False}
    seconds = time.perf_counter() - start
    return {"fits": True, "seconds": round(seconds, 2), "above_weights_gb": round(status_gb("VmHWM") - built, 2),
            "weights_gb": round(weights_gb, 2), "loss": round(float(loss), 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", nargs="+", choices=sorted(SHAPES), default=["smollm2", "qwen3_8b"])
    ap.add_argument("--cases", nargs="+", default=["2048x256", "8192x512"], help="[SHAPE:]TOKENSxANCHORS")
    ap.add_argument("--paths", nargs="+", choices=list(PATHS), default=["before", "after"])
    ap.add_argument("--limit-gb", type=float, default=18.0, help="most memory above the weights a case may take")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layers", type=int, default=1, help="drafter layers (the per-layer term of a plan)")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(**json.loads(a.child))))
        return
    import platform

    info = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").is_file() else []
    cpu = next((l.split(":", 1)[1].strip() for l in info if l.startswith("model name")), platform.processor())
    flags = next((l.split(":", 1)[1].split() for l in info if l.startswith("flags")), [])
    simd = " ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags) or "no avx2"
    print(f"# {cpu} ({simd}), {a.threads} thread(s); one step, no optimizer state; memory above the built model's "
          "weights\n")
    print("| shape | layers | tokens x anchors | path | above weights (GB) | step (s) | loss |")
    print("|---|---|---|---|---|---|---|", flush=True)
    rows = []
    for shape in a.shape:
        for case in a.cases:
            only, _, size = case.rpartition(":")
            if only and only != shape:
                continue
            tokens, anchors = map(int, size.split("x"))
            for path in a.paths:
                args = dict(shape=shape, tokens=tokens, anchors=anchors, path=path, limit_gb=a.limit_gb,
                            threads=a.threads, layers=a.layers)
                run = subprocess.run([sys.executable, __file__, "--child", json.dumps(args)], capture_output=True,
                                     text=True)
                lines = [l for l in run.stdout.splitlines() if l.startswith("{")]
                if run.returncode or not lines:
                    result = {"fits": False, "error": (run.stderr.strip().splitlines() or ["killed"])[-1]}
                else:
                    result = json.loads(lines[-1])
                rows.append({**args, **result})
                if "error" in result and "memory" not in result["error"].lower() and run.returncode > 0:
                    raise SystemExit(f"{shape} {case} {path} failed: {result['error']}")
                if result["fits"]:
                    print(f"| {shape} | {a.layers} | {tokens} x {anchors} | {path} | {result['above_weights_gb']:.2f} | "
                          f"{result['seconds']:.1f} | {result['loss']} |", flush=True)
                else:
                    print(f"| {shape} | {a.layers} | {tokens} x {anchors} | {path} | does not fit in {a.limit_gb:g} GB "
                          f"{result.get('error', '')} | - | - |", flush=True)
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
