"""GPU check: the verify-cost curve, packed drafter training and near-tie exactness at Qwen3-8B's shape, in one run.

    python scripts/gpu_check.py                                  # on a GPU machine (an H200: about 4 minutes)
    python scripts/gpu_check.py --scale tiny --device cpu        # to try it on a CPU (about 20 s on 2 cores)

Needs only torch and transformers >= 5.24 (the project passes `cache=` to the model; up to 5.23 it is called
`past_key_values`, and the check refuses to start), and safetensors, which transformers brings. Where an older
transformers is installed: `pip install --no-deps --target DIR transformers-5.24.0-py3-none-any.whl` and
PYTHONPATH=DIR. No hydra, omegaconf, accelerate, datasets or wandb, no download, and no install of this project: the
package is this checkout (see `use_checkout`).

A random-weight target of Qwen3-8B's shape (bf16, built on the device) and a paper-shape DFlash drafter (5 layers at
the target's width, block 16, 5 tapped layers) on it; then, each section timed:
- costs     eval/policies.py measure_costs after a prefill of random tokens: c(n) = verify n tokens / 1 token,
            n = 1..16, the drafter's block forward, a plain AR step, and trees of 16..128 nodes, in the same unit;
- train     packed multi-anchor drafter steps (data/blocks.py pack_blocks, train/losses.py decay loss) on features
            the target computes for random sequences (models/generation.py recapture), AdamW with float32 weights
            under autocast in the target's dtype (what train/loop.py gets from accelerate's bf16): block positions
            and anchor blocks per second, median ms/step after warm-up, peak memory;
- decodes   autoregressive vs speculative greedy decodes of random prompts (eval/decode.py) with the trained drafter,
            each classified by eval/exactness.py ExactnessJudge (identical / near_tie / wrong, the float32
            log-prob gap at a divergence), tau per decode and the decode speedup (AR time / speculative time).
            A drafter trained on random tokens for a random target drafts little that is accepted (tau near 1,
            speedup below 1): the decodes check exactness and the loop's overheads, not a trained drafter's gain;
- fsdp      with more than one GPU (or --fsdp-procs N): the same packed steps on random features, one process and
            then N processes with the drafter sharded as an FSDP launch shards it (train/parallel.py `shard`:
            FSDP2, each layer's MLP a unit), the same global batch: the losses of both, ms/step, and per process the
            bytes of weights, gradients and AdamW state it holds and its peak memory.
Prints a summary and writes everything as JSON to --out (default $OUT/gpu_check.json when OUT is set, else
./gpu_check.json), atomically, after every section: a run stopped at its time limit keeps what it finished.
"""
from __future__ import annotations

import argparse
import importlib.machinery
import inspect
import importlib.util
import json
import math
import os
import statistics
import sys
import time
import traceback
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
# Not needed here. Reported when imported all the same: transformers imports accelerate itself where it is installed.
UNNEEDED = ("hydra", "omegaconf", "accelerate", "datasets", "wandb")
BLOCK, TAPS, DRAFTER_LAYERS = 16, 5, 5
TREE_SIZES = (16, 32, 64, 128)
# Target shapes: Qwen3-8B's, and a reduced width of the same family (8 layers: 5 distinct taps need at least 8).
SCALES = {
    "qwen3_8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=1000),
}
MASK_TOKEN = {"qwen3_8b": 151669, "tiny": 999}  # Qwen3: the first embedding row past its 151669-token tokenizer
# Per-scale defaults of the run sizes (the tiny ones keep a CPU run well under a minute).
DEFAULTS = {
    "qwen3_8b": dict(context=512, cost_repeats=12, train_steps=300, train_seqs=4, train_len=1024, anchors=256,
                     prompt_len=128, fsdp_steps=10),
    "tiny": dict(context=64, cost_repeats=3, train_steps=5, train_seqs=2, train_len=128, anchors=8, prompt_len=16,
                 fsdp_steps=3),
}


def use_checkout() -> None:
    """Make `dflash_pipeline` the namespace package over this checkout (what pyproject's package-dir maps:
    dflash_pipeline.models is models/ here). A GPU machine has a plain checkout, not an install; and an editable
    install of another checkout must not be what gets measured."""
    spec = importlib.machinery.ModuleSpec("dflash_pipeline", None, is_package=True)
    spec.submodule_search_locations = [str(ROOT)]
    sys.modules["dflash_pipeline"] = importlib.util.module_from_spec(spec)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scale", choices=sorted(SCALES), default="qwen3_8b",
                    help="the target's shape (default: %(default)s)")
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    ap.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16",
                    help="the target's (default: %(default)s)")
    ap.add_argument("--context", type=int, help="random tokens before the cost curve (default: 512; tiny 64)")
    ap.add_argument("--cost-repeats", type=int, help="measure_costs passes (default: 12; tiny 3)")
    ap.add_argument("--train-steps", type=int, help="optimizer steps (default: 300; tiny 5)")
    ap.add_argument("--train-seqs", type=int, help="sequences per step (default: 4; tiny 2)")
    ap.add_argument("--train-len", type=int, help="tokens per sequence (default: 1024; tiny 128)")
    ap.add_argument("--anchors", type=int, help="anchor blocks per sequence (default: 256; tiny 8)")
    ap.add_argument("--train-budget-s", type=float, default=240.0,
                    help="stop training after this many seconds (default: %(default)s)")
    ap.add_argument("--lr", type=float, default=6e-4, help="AdamW's, constant (default: %(default)s)")
    ap.add_argument("--decodes", type=int, default=4, help="prompts decoded both ways (default: %(default)s)")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="per decode (default: %(default)s)")
    ap.add_argument("--prompt-len", type=int, help="random prompt tokens per decode (default: 128; tiny 16)")
    ap.add_argument("--tolerance", type=float, default=None,
                    help="near-tie tolerance in nats (default: eval.exactness.DEFAULT_TOLERANCE)")
    ap.add_argument("--fsdp-procs", type=int, default=None,
                    help="processes of the fsdp section (default: the GPU count when above 1, else the section is "
                         "skipped; on a CPU, gloo processes)")
    ap.add_argument("--fsdp-steps", type=int, default=None, help="steps per fsdp run (default: 10; tiny 3)")
    ap.add_argument("--seed", type=int, default=0, help="weights, tokens and anchors (default: %(default)s)")
    ap.add_argument("--out", default=None, help="default: $OUT/gpu_check.json when OUT is set, else gpu_check.json")
    args = ap.parse_args()
    for k, v in DEFAULTS[args.scale].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.out = Path(args.out or Path(os.environ.get("OUT", ".")) / "gpu_check.json")
    return args


class Run:
    """The results, written out after every section; a section that fails is recorded and the run goes on."""

    def __init__(self, out: Path, device):
        self.out, self.device, self.results = out, device, {"seconds": {}, "errors": {}}
        self.t0 = time.perf_counter()

    def sync(self) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextmanager
    def section(self, name: str):
        print(f"== {name}", flush=True)
        t0 = time.perf_counter()
        try:
            yield self.results.setdefault(name, {})
        except Exception as e:  # noqa: BLE001  (recorded, and the exit code says so)
            traceback.print_exc()
            self.results["errors"][name] = f"{type(e).__name__}: {e}"
        finally:
            self.results["seconds"][name] = round(time.perf_counter() - t0, 2)
            self.write()

    def write(self) -> None:
        """Atomically: a tmp file in the same folder, then os.replace."""
        self.results["seconds"].pop("total", None)  # kept last
        self.results["seconds"]["total"] = round(time.perf_counter() - self.t0, 2)
        self.results["unneeded_imported"] = [m for m in UNNEEDED if sys.modules.get(m) is not None]
        self.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.out.with_name(f".{self.out.name}.tmp{os.getpid()}")
        tmp.write_text(json.dumps(self.results, indent=1))
        os.replace(tmp, self.out)


def peak_memory_gib(device) -> float | None:
    """Peak allocated device memory since the last reset_peak_memory_stats, or on a CPU the process's peak
    resident set (never reset)."""
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    except ImportError:
        return None


def build_target(scale: str, device, dtype):
    """Random weights of the scale's shape, created on the device in the dtype (no float32 pass, no copy)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**SCALES[scale], rope_theta=1e6, max_position_embeddings=40960, tie_word_embeddings=False,
                         attn_implementation="sdpa")  # eval/tree.py verifies trees with a dense mask
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Qwen3ForCausalLM(config)
    finally:
        torch.set_default_dtype(before)
    return model.eval().requires_grad_(False)


def build_drafter(model, scale: str, device):
    """The paper shape: 5 layers at the target's width, block 16, 5 taps spaced as models/target.py spaces them.
    Float32 weights (as training keeps them); cast for inference."""
    import torch

    from dflash_pipeline.models.drafter import DFlashDrafter, DFlashDrafterConfig
    from dflash_pipeline.models.target import default_layer_ids

    tc = model.config
    conf = DFlashDrafterConfig(
        hidden_size=tc.hidden_size, intermediate_size=tc.intermediate_size, num_hidden_layers=DRAFTER_LAYERS,
        num_attention_heads=tc.num_attention_heads, num_key_value_heads=tc.num_key_value_heads,
        head_dim=tc.head_dim, rms_norm_eps=tc.rms_norm_eps, rope_theta=tc.rope_parameters["rope_theta"],
        max_position_embeddings=tc.max_position_embeddings, vocab_size=tc.vocab_size, block_size=BLOCK,
        target_hidden_size=tc.hidden_size, target_layer_ids=default_layer_ids(tc.num_hidden_layers, TAPS),
        num_target_layers=tc.num_hidden_layers, mask_token_id=MASK_TOKEN[scale])
    with torch.device(device):
        return DFlashDrafter(conf, model.get_input_embeddings(), model.get_output_embeddings())


def random_ids(n: int, low_vocab: int, gen) -> list[int]:
    import torch

    return torch.randint(0, low_vocab, (n,), generator=gen).tolist()


def train(run: Run, res: dict, model, drafter, args, dtype, gen) -> None:
    """Packed multi-anchor steps as DrafterComponent.loss + train/loop.py run them (decay loss, global normaliser,
    grad clip 1), on features the target computes now for random sequences; constant lr (no schedule)."""
    import torch

    from dflash_pipeline.data.blocks import pack_blocks
    from dflash_pipeline.data.splits import anchor_generators
    from dflash_pipeline.models.generation import recapture
    from dflash_pipeline.train.losses import block_loss, default_gamma, effective_valid, normaliser

    device, conf = run.device, drafter.config
    items = [{"input_ids": torch.tensor(random_ids(args.train_len, conf.mask_token_id, gen)),
              "loss_mask": torch.arange(args.train_len) > 0} for _ in range(args.train_seqs)]
    recapture(model, items, conf.target_layer_ids, pad_id=0)  # features on the CPU, as teacher data is stored
    gamma = default_gamma(BLOCK)
    drafter.float().train()
    to_column = drafter.target_to_column()
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    losses, step_s, pack_s, blocks = [], [], [], []
    start = time.perf_counter()
    for step in range(args.train_steps):
        run.sync()
        t0 = time.perf_counter()
        batch = pack_blocks(items, block_size=BLOCK, mask_token_id=conf.mask_token_id,
                            anchors_per_sequence=args.anchors,
                            generators=anchor_generators(args.seed, step, 0, len(items)))
        b = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        t1 = time.perf_counter()
        keep = b["anchor_valid"]
        labels, label_valid = to_column[b["labels"][keep]], b["label_valid"][keep]
        norm = normaliser("decay", effective_valid("decay", labels, label_valid), gamma)
        with autocast:
            hidden = drafter(b["features"], b["block_ids"], b["anchor_pos"], b["context_valid"], keep)
            logits = drafter.logits(hidden[keep][:, 1:])  # (N, B-1, V)
            loss_sum = block_loss(logits, labels, label_valid, kind="decay", gamma=gamma)
        (loss_sum / max(norm, 1e-9)).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss_sum.item() / max(norm, 1e-9))  # .item() syncs: the step is done
        step_s.append(time.perf_counter() - t0)
        pack_s.append(t1 - t0)
        blocks.append(int(batch["anchor_valid"].sum()))
        if step % 50 == 0 or step + 1 == args.train_steps:
            print(f"  step {step + 1}/{args.train_steps} loss {losses[-1]:.4f} {1e3 * step_s[-1]:.0f} ms", flush=True)
        if time.perf_counter() - start > args.train_budget_s:
            print(f"  stopped after {step + 1} steps: --train-budget-s {args.train_budget_s} reached", flush=True)
            break
    warm = min(10, len(step_s) // 3)  # the first steps pay for allocation and kernel selection
    ms = 1e3 * statistics.median(step_s[warm:])
    per_step = statistics.mean(blocks[warm:])
    res.update(steps=len(step_s), warmup_steps=warm, sequences=args.train_seqs, seq_len=args.train_len,
               anchors_per_sequence=args.anchors, drafter_params_m=sum(p.numel() for p in params) / 1e6,
               autocast=str(dtype).removeprefix("torch.") if dtype != torch.float32 else "off",
               ms_per_step=ms, pack_ms=1e3 * statistics.median(pack_s[warm:]), anchor_blocks_per_step=per_step,
               anchor_blocks_per_s=1e3 * per_step / ms, block_positions_per_s=1e3 * per_step * BLOCK / ms,
               context_tokens_per_s=1e3 * args.train_seqs * args.train_len / ms,  # train/loop.py's tokens_per_s
               peak_memory_gib=peak_memory_gib(device), losses=losses,
               losses_finite=all(math.isfinite(x) for x in losses))


def decodes(run: Run, res: dict, target, drafter, args, gen) -> None:
    """AR vs speculative greedy decodes of random prompts, each speculative output classified against the AR one."""
    import torch

    from dflash_pipeline.eval.decode import autoregressive, speculative
    from dflash_pipeline.eval.exactness import DEFAULT_TOLERANCE, ExactnessJudge, rounds_before

    tolerance = DEFAULT_TOLERANCE if args.tolerance is None else args.tolerance
    if run.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(run.device)
    judge = ExactnessJudge(target.model, tolerance)
    vocab = drafter.config.mask_token_id
    warm = random_ids(args.prompt_len, vocab, gen)
    autoregressive(target, warm, 8), speculative(target, drafter, warm, 8, BLOCK)  # untimed warm-up
    rows = []
    for i in range(args.decodes):
        prompt = random_ids(args.prompt_len, vocab, gen)
        ar, t = autoregressive(target, prompt, args.max_new_tokens)
        s = speculative(target, drafter, prompt, args.max_new_tokens, BLOCK)
        v = judge.classify(prompt, ar, s.tokens)
        rows.append({"kind": v.kind, "position": v.position, "logprob_gap": v.detail.get("logprob_gap"),
                     "detail": v.detail, "tau": s.tau, "rounds": len(s.accepted),
                     "rounds_before_divergence": len(rounds_before(s.accepted, v.position)),
                     "ar_s": t["total_s"], "ar_decode_s": t["decode_s"], "spec_s": s.total_s,
                     "spec_decode_s": s.total_s - s.prefill_s, "tokens": len(ar)})
        print(f"  decode {i + 1}: {v.kind} at {v.position}, tau {s.tau:.2f}, AR {t['total_s']:.2f} s, "
              f"speculative {s.total_s:.2f} s", flush=True)
    peak = peak_memory_gib(run.device)  # with the float32 copy of the target (32 GB at 8B), freed now
    judge._float32 = None
    if run.device.type == "cuda":
        torch.cuda.empty_cache()
    counts = {k: sum(r["kind"] == k for r in rows) for k in ("identical", "near_tie", "wrong")}
    res.update(tolerance=tolerance, peak_memory_gib=peak, prompt_len=args.prompt_len,
               max_new_tokens=args.max_new_tokens, counts=counts, decodes=rows, tau=[r["tau"] for r in rows],
               speedup=sum(r["ar_s"] for r in rows) / max(1e-9, sum(r["spec_s"] for r in rows)),
               decode_speedup=sum(r["ar_decode_s"] for r in rows) / max(1e-9, sum(r["spec_decode_s"] for r in rows)))


class _Embeddings:
    """What build_drafter reads of a target: its config and its embedding and LM-head modules (random, frozen)."""

    def __init__(self, scale: str, device, dtype):
        import torch
        from transformers import Qwen3Config

        self.config = Qwen3Config(**SCALES[scale], rope_theta=1e6, max_position_embeddings=40960)
        V, H = self.config.vocab_size, self.config.hidden_size
        with torch.device(device):
            self.embed = torch.nn.Embedding(V, H, dtype=dtype).requires_grad_(False)
            self.head = torch.nn.Linear(H, V, bias=False, dtype=dtype).requires_grad_(False)

    def get_input_embeddings(self):
        return self.embed

    def get_output_embeddings(self):
        return self.head


def fsdp_worker(rank: int, world: int, args: argparse.Namespace, port: int, out: str) -> None:
    """One process of an fsdp run: the drafter (sharded when world > 1), `args.fsdp_steps` packed steps of the global
    batch (this rank's slice), decay loss over the global normaliser; rank 0 writes the run's figures to `out`."""
    use_checkout()
    import torch
    import torch.distributed as dist

    from dflash_pipeline.data.blocks import pack_blocks
    from dflash_pipeline.data.splits import anchor_generators
    from dflash_pipeline.train.losses import block_loss, default_gamma, effective_valid, normaliser
    from dflash_pipeline.train.parallel import shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = args.device.startswith("cuda")
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        torch.cuda.reset_peak_memory_stats(device)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(args.seed)  # the same initial weights in every process
    drafter = build_drafter(_Embeddings(args.scale, device, dtype), args.scale, device).float().train()
    conf = drafter.config
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh

        drafter = shard(drafter, init_device_mesh(device.type, (world,)))
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
    to_column, gamma = drafter.target_to_column(), default_gamma(BLOCK)
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
    gen = torch.Generator().manual_seed(args.seed + 1)  # the same global batch in every process
    seqs = max(world, args.train_seqs - args.train_seqs % world)
    losses, step_s = [], []
    for step in range(args.fsdp_steps):
        items = [{"input_ids": torch.randint(0, conf.mask_token_id, (args.train_len,), generator=gen),
                  "loss_mask": torch.arange(args.train_len) > 0,
                  "features": torch.randn(args.train_len, TAPS * conf.target_hidden_size, generator=gen)}
                 for _ in range(seqs)]
        per = seqs // world
        if cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        batch = pack_blocks(items[rank * per:(rank + 1) * per], block_size=BLOCK, mask_token_id=conf.mask_token_id,
                            anchors_per_sequence=args.anchors,
                            generators=anchor_generators(args.seed, step, rank * per, per))
        b = {k: v.to(device) for k, v in batch.items()}
        keep = b["anchor_valid"]
        labels, label_valid = to_column[b["labels"][keep]], b["label_valid"][keep]
        norm = torch.tensor(float(normaliser("decay", effective_valid("decay", labels, label_valid), gamma)),
                            device=device)
        dist.all_reduce(norm)
        with autocast:
            hidden = drafter(b["features"], b["block_ids"], b["anchor_pos"], b["context_valid"], keep)
            loss_sum = block_loss(drafter.logits(hidden[keep][:, 1:]), labels, label_valid, kind="decay", gamma=gamma)
        (loss_sum * world / norm).backward()  # FSDP averages gradients over processes, as DDP does
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        total = loss_sum.detach().float()
        dist.all_reduce(total)
        losses.append(float(total / norm))
        step_s.append(time.perf_counter() - t0)

    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    held = torch.tensor(float(sum(local(p).numel() * 16 for p in params)), device=device)  # weights, grads, 2 moments
    peak = torch.tensor(peak_memory_gib(device) or 0.0, device=device)
    dist.all_reduce(held, op=dist.ReduceOp.MAX)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if rank == 0:
        Path(out).write_text(json.dumps({
            "processes": world, "sequences_per_step": seqs, "losses": losses,
            "ms_per_step": 1e3 * statistics.median(step_s[1:] or step_s), "state_gib_per_process": float(held) / 2**30,
            "peak_memory_gib_per_process": float(peak), "drafter_params_m": sum(p.numel() for p in params) / 1e6
            if world == 1 else None}))
    dist.destroy_process_group()


def fsdp(run: Run, res: dict, args) -> None:
    """The fsdp section: one process, then args.fsdp_procs, the same global batch; each run in processes of its
    own (torch.multiprocessing), so the parent's memory does not count."""
    import socket
    import tempfile

    import torch.multiprocessing as mp

    runs = {}
    for world in (1, args.fsdp_procs):
        with tempfile.TemporaryDirectory() as tmp, socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
            sock.close()
            out = str(Path(tmp) / "fsdp.json")
            mp.spawn(fsdp_worker, args=(world, args, port, out), nprocs=world, join=True)
            runs[world] = json.loads(Path(out).read_text())
        print(f"  {world} process(es): {runs[world]['ms_per_step']:.0f} ms/step, state "
              f"{runs[world]['state_gib_per_process']:.2f} GiB per process, losses "
              f"{[round(x, 4) for x in runs[world]['losses']]}", flush=True)
    one, many = runs[1], runs[args.fsdp_procs]
    res.update(runs={str(k): v for k, v in runs.items()},
               loss_max_rel_diff=max(abs(a - b) / abs(a) for a, b in zip(one["losses"], many["losses"])),
               state_ratio=many["state_gib_per_process"] / one["state_gib_per_process"],
               step_time_ratio=many["ms_per_step"] / one["ms_per_step"])


def summary(r: dict) -> None:
    m = r.get("machine", {})
    print(f"\n{m.get('gpu') or m.get('cpu')}: torch {m.get('torch')}, transformers {m.get('transformers')}, "
          f"{r['config']['scale']} {r['config']['dtype']} on {r['config']['device']}")
    c = r.get("costs", {})
    if "verify_cost" in c:
        print(f"c(n), n=1..{BLOCK}: {[round(x, 2) for x in c['verify_cost']]}; draft {c['draft_cost']:.2f}, AR step "
              f"{c['ar_step_cost']:.2f}, unit {c['step_ms']:.2f} ms at {c['context_tokens']} tokens; trees "
              f"{ {n: round(x, 2) for n, x in c['tree_cost'].items()} }")
    t = r.get("train", {})
    if "ms_per_step" in t:
        print(f"train: {t['steps']} steps, {t['ms_per_step']:.1f} ms/step (pack {t['pack_ms']:.1f}), "
              f"{t['block_positions_per_s']:.0f} block positions/s, {t['anchor_blocks_per_s']:.1f} anchor blocks/s, "
              f"peak {t['peak_memory_gib'] or float('nan'):.1f} GiB, loss {t['losses'][0]:.3f} -> "
              f"{t['losses'][-1]:.3f}")
    d = r.get("decodes", {})
    if "counts" in d:
        gaps = [(x["position"], x["logprob_gap"]) for x in d["decodes"] if x["kind"] != "identical"]
        print(f"exactness: {d['counts']}, divergences (position, gap) {gaps}; tau {[round(x, 2) for x in d['tau']]};"
              f" speedup {d['speedup']:.2f}x (decode only {d['decode_speedup']:.2f}x)")
    f = r.get("fsdp", {})
    if "state_ratio" in f:
        n = max(int(k) for k in f["runs"])
        print(f"fsdp over {n} processes: state per process {f['state_ratio']:.3f} of one process's, ms/step "
              f"{f['step_time_ratio']:.2f}x, losses within {f['loss_max_rel_diff']:.1e} (relative)")
    print(f"seconds: {r['seconds']}; errors: {r['errors'] or 'none'}")


def main() -> int:
    args = parse_args()
    use_checkout()
    import torch
    import transformers

    from dflash_pipeline.models.precision import machine

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: no GPU is visible")
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    run = Run(args.out, device)
    r = run.results
    r["machine"] = {**machine(), "transformers": transformers.__version__,
                    "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None}
    r["config"] = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    r["package_root"] = str(Path(sys.modules["dflash_pipeline.models"].__file__).parents[1])  # where it came from
    with run.section("build") as res:
        from transformers.models.qwen3.modeling_qwen3 import Qwen3Model

        if "cache" not in inspect.signature(Qwen3Model.forward).parameters:  # else the KV cache is silently unused
            raise RuntimeError(f"transformers {transformers.__version__} calls the KV cache `past_key_values`; the "
                               "project passes `cache=` (transformers >= 5.24)")
        model = build_target(args.scale, device, dtype)
        drafter = build_drafter(model, args.scale, device)
        run.sync()
        res.update(target_params_b=sum(p.numel() for p in model.parameters()) / 1e9,
                   memory_gib=torch.cuda.memory_allocated(device) / 2**30 if device.type == "cuda" else None,
                   drafter_layer_ids=drafter.config.target_layer_ids, mask_token_id=drafter.config.mask_token_id)
    if "build" in r["errors"]:
        summary(r)
        return 1
    target = SimpleNamespace(model=model, eos_ids=set())
    with run.section("costs") as res:
        from dflash_pipeline.eval.policies import measure_costs

        drafter.to(dtype).eval()
        res.update(measure_costs(target, drafter, random_ids(args.context, drafter.config.mask_token_id, gen), BLOCK,
                                 repeats=args.cost_repeats, tree_sizes=TREE_SIZES))
    with run.section("train") as res:
        train(run, res, model, drafter, args, dtype, gen)
    drafter.zero_grad(set_to_none=True)  # also after a failed step
    if device.type == "cuda":
        torch.cuda.empty_cache()
    with run.section("decodes") as res:
        drafter.to(dtype).eval()
        decodes(run, res, target, drafter, args, gen)
    if args.fsdp_procs is None and device.type == "cuda" and torch.cuda.device_count() > 1:
        args.fsdp_procs = torch.cuda.device_count()
    if args.fsdp_procs and args.fsdp_procs > 1:
        del model, drafter, target  # the fsdp processes build their own
        if device.type == "cuda":
            torch.cuda.empty_cache()
        with run.section("fsdp") as res:
            fsdp(run, res, args)
    run.write()
    summary(r)
    return 1 if r["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
