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
- kernels   the drafter's attention kernels on one packed batch in float32 (flex_attention compiled with its block
            mask; sdpa with the whole mask and in row slices): outputs and gradients against eager (the largest
            difference relative to the largest entry, failing past KERNEL_TOLERANCE), and ms per forward + backward
            of each;
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
            bytes of weights, gradients and AdamW state it holds and its peak memory;
- dflash2   where `import vllm` works in this python (else recorded as skipped): vLLM serves a DFlash2 drafter end to
            end. A random Qwen3 target of its own (DFLASH2_TARGET, saved as a folder; no tokenizer: prompts are token
            ids) and a random DFlash2 drafter on it (convolution of 3 taps, block 8, 2 taps) with a random selector
            (rank 8, top 8), exported as train/frozen.py export_with_drafter exports a trained selector; then greedy
            vLLM runs of random prompts with speculative_config {"method": "dflash", num_speculative_tokens 7} and
            without, each engine in a process of its own: whether the speculative outputs equal the plain ones, the
            engine's acceptance counters per draft position, and whether transformers' greedy `generate` on the
            same weights equals vLLM's plain outputs. An engine's refusal (vLLM's CPU build: "Model Runner V1 does
            not support: DFlash candidate-head drafts") is the section's error. It builds its own target, so it also
            runs when the build section fails (vLLM pins a transformers older than the project's).
--skip SECTION... leaves sections out (e.g. `--skip costs train decodes fsdp` runs only dflash2 after the build).
Prints a summary and writes everything as JSON to --out (default $OUT/gpu_check.json when OUT is set, else
./gpu_check.json), atomically, after every section: a run stopped at its time limit keeps what it finished.
Exits 1 when a check fails (`failures`: a section's error, a kernel past KERNEL_TOLERANCE, a non-finite training
loss, a decode or served output that is wrong rather than a near-tie), each failure one line `FAILED ...`, also
under "failures" in the JSON.
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
OPTIONAL = ("costs", "kernels", "train", "decodes", "fsdp", "dflash2")  # what --skip may leave out
# The dflash2 section's target: the tiny family at a head_dim vLLM's attention kernels take, weights large enough
# (initializer_range) that greedy picks are not near-ties; taps as models/families.py default_layer_ids(4, 2).
DFLASH2_TARGET = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=64, vocab_size=1024, initializer_range=0.1)
DFLASH2_TAPS, DFLASH2_BLOCK, DFLASH2_PROMPTS, DFLASH2_PROMPT_LEN, DFLASH2_NEW_TOKENS = [0, 3], 8, 4, 32, 48
# The kernels section's verdict on each kernel against eager: the largest difference of its output and of each
# gradient, relative to the largest entry, at most this. The section runs the drafter in float32 (no autocast; IEEE
# matmuls, torch's default, in flex's compiled kernel too), where only the order of sums differs: sdpa against eager
# measured on a CPU at output 3e-7 and gradients 8e-5 (tiny scale), 1.6e-6 and 2.2e-4 (width 1024, 512-token
# sequences), the gradients' growing with the shape (the norms' gradients are sums that cancel). A wrong mask or a
# wrong backward moves them by 1e-1 and more.
KERNEL_TOLERANCE = {"out": 1e-4, "grad": 1e-2}
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
    ap.add_argument("--kernel-tolerance", type=float, nargs=2, metavar=("OUT", "GRAD"),
                    default=[KERNEL_TOLERANCE["out"], KERNEL_TOLERANCE["grad"]],
                    help="the kernels' largest relative difference from eager, output and gradients "
                         "(default: %(default)s, KERNEL_TOLERANCE)")
    ap.add_argument("--fsdp-procs", type=int, default=None,
                    help="processes of the fsdp section (default: the GPU count when above 1, else the section is "
                         "skipped; on a CPU, gloo processes)")
    ap.add_argument("--fsdp-steps", type=int, default=None, help="steps per fsdp run (default: 10; tiny 3)")
    ap.add_argument("--skip", nargs="+", choices=OPTIONAL, default=[], metavar="SECTION",
                    help=f"sections to leave out, of {', '.join(OPTIONAL)}")
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
    """The paper shape: 5 layers at the target's width, block 16, 5 taps spaced as models/families.py spaces them.
    Float32 weights (as training keeps them); cast for inference."""
    import torch

    from dflash_pipeline.models.drafter import DFlashDrafter, DFlashDrafterConfig
    from dflash_pipeline.models.families import default_layer_ids

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


def kernels(run: Run, res: dict, drafter, args, gen) -> None:
    """flex_attention (compiled, with the packed block mask) and sdpa (whole mask, row slices) against eager: the
    training step's outputs and gradients on one packed batch, and the time of each (tests/test_drafter_modules.py
    checks flex's forward on a CPU, where torch has no flex backward)."""
    import torch

    from dflash_pipeline.data.blocks import pack_blocks

    device, conf = run.device, drafter.config
    width = len(conf.target_layer_ids) * conf.target_hidden_size
    items = [{"input_ids": torch.tensor(random_ids(args.train_len, conf.mask_token_id, gen)),
              "loss_mask": torch.arange(args.train_len) > 0, "features": torch.randn(args.train_len, width)}
             for _ in range(2)]
    b = {k: v.to(device) for k, v in pack_blocks(items, block_size=BLOCK, mask_token_id=conf.mask_token_id,
                                                  anchors_per_sequence=args.anchors).items()}
    drafter.float().train()
    kept = {"attn_implementation": conf.attn_implementation, "attention_chunk_mb": conf.attention_chunk_mb}
    results = {}
    paths = [("eager", "eager", 0.0), ("sdpa", "sdpa", 0.0), ("sdpa_sliced", "sdpa", 1.0)]
    paths += [("flex", "flex", 0.0)] if device.type == "cuda" else []  # no flex backward on a CPU
    for name, impl, chunk_mb in paths:
        conf.attn_implementation, conf.attention_chunk_mb = impl, chunk_mb
        times = []
        for _ in range(3):  # the first also compiles
            drafter.zero_grad(set_to_none=True)
            run.sync()
            t0 = time.perf_counter()
            hidden = drafter(b["features"], b["block_ids"], b["anchor_pos"], b["context_valid"], b["anchor_valid"])
            drafter.logits(hidden[b["anchor_valid"]][:, 1:]).float().logsumexp(-1).sum().backward()
            run.sync()
            times.append(time.perf_counter() - t0)
        results[name] = (hidden.detach(), {n: p.grad.detach().clone() for n, p in drafter.named_parameters()})
        res[f"{name}_ms"] = 1e3 * min(times[1:])
    conf.attn_implementation, conf.attention_chunk_mb = kept["attn_implementation"], kept["attention_chunk_mb"]
    drafter.zero_grad(set_to_none=True)
    want_out, want_grads = results.pop("eager")
    for name, (out, grads) in results.items():
        res[f"{name}_out_rel_diff"] = float((out - want_out).abs().max() / want_out.abs().max())
        res[f"{name}_grad_rel_diff"] = max(float((grads[n] - g).abs().max() / g.abs().max().clamp(min=1e-30))
                                           for n, g in want_grads.items())


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
    del drafter, opt, params, hidden, loss_sum  # they hold the process group: see close_process_group
    close_process_group()


def close_process_group() -> None:
    """End this process's part of an fsdp run so that it exits cleanly. The sharded model, its optimizer and its
    parameters hold the device mesh and through it the gloo process group, in reference cycles (FSDP's hooks) that only
    the garbage collector frees: left to the interpreter's exit, the group's C++ side is torn down while Python is
    being finalized, and one process in a few died there with SIGABRT ('terminate called without an active
    exception'). So, once the caller has dropped them: every process done communicating (a barrier), the cycles
    collected while Python is whole, then the group destroyed."""
    import gc

    import torch.distributed as dist

    dist.barrier()
    gc.collect()
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


def dflash2_exports(folder: Path, seed: int):
    """The dflash2 section's checkpoints, built on the CPU in float32: a random Qwen3 target saved to folder/target,
    and a DFlash2 drafter on it with a random PairSelector exported to folder/dflash2, every drafter and selector
    weight random at std 0.5 (as tests/test_engine_parity.py makes them) so that the drafts vary.
    -> (the target, how the selector was added)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from dflash_pipeline.models.drafter import DFlashDrafter, DFlashDrafterConfig
    from dflash_pipeline.models.selector import SELECTOR_PREFIX, PairSelector

    torch.manual_seed(seed)
    tc = Qwen3Config(**DFLASH2_TARGET, rope_theta=1e6, max_position_embeddings=4096, tie_word_embeddings=False)
    target = Qwen3ForCausalLM(tc).eval()
    target.save_pretrained(folder / "target")
    V, H = tc.vocab_size, tc.hidden_size
    conf = DFlashDrafterConfig(
        hidden_size=H, intermediate_size=tc.intermediate_size, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=tc.head_dim, rms_norm_eps=tc.rms_norm_eps, rope_theta=1e6,
        max_position_embeddings=4096, vocab_size=V, block_size=DFLASH2_BLOCK, target_hidden_size=H,
        target_layer_ids=DFLASH2_TAPS, num_target_layers=tc.num_hidden_layers, mask_token_id=V - 1,
        conv_kernel_size=3, conv_group_size=32)
    drafter = DFlashDrafter(conf, target.get_input_embeddings(), target.get_output_embeddings())
    selector = PairSelector(V, H, rank=8, top_k=8)
    with torch.no_grad():
        for p in [*drafter.parameters(), *selector.parameters()]:
            p.normal_(std=0.5)
    drafter.save_pretrained(str(folder / "drafter"))  # a DFlash2DraftModel export with the pass-through selector
    tensors = {SELECTOR_PREFIX + k: v.detach().contiguous() for k, v in selector.state_dict().items()}
    try:
        from dflash_pipeline.train.frozen import export_with_drafter
    except ImportError as e:  # that module needs omegaconf (and more), which this check does not: the same steps
        from safetensors.torch import load_file, save_file

        config = json.loads((folder / "drafter" / "config.json").read_text())
        config["dflash_config"].update(selector.config_dict())
        weights = {k: v for k, v in load_file(str(folder / "drafter" / "model.safetensors")).items()
                   if not k.startswith(SELECTOR_PREFIX)}
        (folder / "dflash2").mkdir()
        save_file({**weights, **tensors}, str(folder / "dflash2" / "model.safetensors"), metadata={"format": "pt"})
        (folder / "dflash2" / "config.json").write_text(json.dumps(config, indent=2))
        return target, f"inline ({type(e).__name__}: {e})"
    export_with_drafter(folder / "drafter", folder / "dflash2", tensors, selector.config_dict(), "selector", {})
    return target, "train/frozen.py export_with_drafter"


def vllm_engine(settings: dict, out: str) -> None:
    """One vLLM engine in a process of its own (its GPU memory goes with it), the engine core in this process so that
    a refusal arrives here as an exception: greedy outputs of settings["prompts"] (token ids, no tokenizer) and the
    speculative counters (models/vllm_worker.py `counters`), or the first line of the root cause, as JSON to out."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    use_checkout()
    try:
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        from dflash_pipeline.models.vllm_worker import counters

        llm = LLM(model=settings["model"], skip_tokenizer_init=True, dtype=settings["dtype"], max_model_len=256,
                  max_num_seqs=8, enforce_eager=True, seed=0, disable_log_stats=False, gpu_memory_utilization=0.3,
                  speculative_config=settings["speculative"])
        params = SamplingParams(temperature=0.0, max_tokens=settings["max_tokens"], detokenize=False)
        done = llm.generate([TokensPrompt(prompt_token_ids=p) for p in settings["prompts"]], params, use_tqdm=False)
        result = {"outputs": [list(o.outputs[0].token_ids) for o in done], "spec": counters(llm)}
    except Exception as e:  # noqa: BLE001  (the parent records it)
        traceback.print_exc()
        while e.__cause__ or e.__context__:
            e = e.__cause__ or e.__context__
        # pydantic's first line only counts its errors (vLLM's config refusals are pydantic ValidationErrors)
        text = "; ".join(x["msg"] for x in e.errors()) if type(e).__name__ == "ValidationError" else str(e)
        result = {"error": f"{type(e).__name__}: {(text.splitlines() or [''])[0]}"}
    Path(out).write_text(json.dumps(result))


def verdicts(target, prompts: list, outputs: list, reference: list, tolerance: float) -> list[dict]:
    """Each output against its reference as eval/exactness.py classifies them: identical, near_tie (at the first
    difference the two picks' log-probabilities under the float32 target, on the shared prefix, differ by less than
    `tolerance`; the gap is logp(output's pick) - logp(reference's pick)) or wrong (a clear winner replaced, or a
    length difference)."""
    import torch

    rows = []
    for prompt, a, b in zip(prompts, outputs, reference):
        i, gap = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None), None
        if i is not None:
            with torch.no_grad():
                logp = target(torch.tensor([prompt + a[:i]])).logits[0, -1].float().log_softmax(-1)
            gap = float(logp[a[i]] - logp[b[i]])
            kind = "near_tie" if abs(gap) < tolerance else "wrong"
        elif len(a) != len(b):
            i, kind = min(len(a), len(b)), "wrong"
        else:
            kind = "identical"
        rows.append({"kind": kind, "position": i, "logprob_gap": gap})
    return rows


def dflash2(run: Run, res: dict, args) -> None:
    """The dflash2 section (module docstring): plain and speculative vLLM runs, then transformers' greedy decodes."""
    try:
        import vllm
    except Exception as e:  # noqa: BLE001
        res["skipped"] = f"vllm is not importable: {type(e).__name__}: {e}"
        print(f"  skipped: {res['skipped']}", flush=True)
        return
    import copy
    import multiprocessing
    import tempfile

    import torch

    gen = torch.Generator().manual_seed(args.seed)
    prompts = [random_ids(DFLASH2_PROMPT_LEN, DFLASH2_TARGET["vocab_size"] - 1, gen) for _ in range(DFLASH2_PROMPTS)]
    res.update(vllm=vllm.__version__, dtype=args.dtype, prompts=len(prompts), prompt_len=DFLASH2_PROMPT_LEN,
               max_new_tokens=DFLASH2_NEW_TOKENS, num_speculative_tokens=DFLASH2_BLOCK - 1,
               model_runner_env=os.environ.get("VLLM_USE_V2_MODEL_RUNNER"))
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        target, res["export"] = dflash2_exports(folder, args.seed)
        spec = {"method": "dflash", "model": str(folder / "dflash2"), "num_speculative_tokens": DFLASH2_BLOCK - 1}
        for name, speculative in (("plain", None), ("speculative", spec)):
            settings = dict(model=str(folder / "target"), dtype=args.dtype, prompts=prompts,
                            max_tokens=DFLASH2_NEW_TOKENS, speculative=speculative)
            out = folder / f"{name}.json"
            proc = multiprocessing.get_context("spawn").Process(target=vllm_engine, args=(settings, str(out)))
            proc.start()
            proc.join(300)
            if proc.is_alive():
                proc.terminate()
                proc.join()
            runs[name] = json.loads(out.read_text()) if out.exists() else {
                "error": f"the engine's process ended with exit code {proc.exitcode} (300 s allowed)"}
            print(f"  vLLM {name}: {runs[name].get('error') or 'done'}", flush=True)
    from dflash_pipeline.eval.exactness import DEFAULT_TOLERANCE

    tolerance = DEFAULT_TOLERANCE if args.tolerance is None else args.tolerance
    plain, s = runs["plain"].get("outputs"), runs["speculative"].get("outputs")
    res.update(tolerance=tolerance, outputs={"plain": plain, "speculative": s})
    if plain and s:
        res.update(spec_equals_plain=s == plain, spec_vs_plain=verdicts(target, prompts, s, plain, tolerance))
    if s:
        c = runs["speculative"]["spec"]
        res.update(counters=c, tau=1 + c["accepted"] / max(1, c["drafts"]),
                   acceptance_per_pos=[a / max(1, c["drafts"]) for a in c["accepted_per_pos"]])
    if plain:  # transformers' greedy decodes, in the engines' dtype on the device
        ids = torch.tensor(prompts, device=run.device)
        with torch.no_grad():
            hf = copy.deepcopy(target).to(run.device, getattr(torch, args.dtype)).generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=DFLASH2_NEW_TOKENS,
                pad_token_id=0)[:, DFLASH2_PROMPT_LEN:].tolist()
        res.update(hf_equals_plain=hf == plain, hf_vs_plain=verdicts(target, prompts, hf, plain, tolerance))
    errors = [f"vLLM {name}: {r['error']}" for name, r in runs.items() if "error" in r]
    if errors:
        raise RuntimeError("; ".join(errors))


def failures(r: dict) -> list[str]:
    """Every check the results fail, one line each: a section's error, a kernel's output or gradients further from
    eager than the run's kernel tolerance (NaN too), a non-finite training loss, and a decode or served output
    classified wrong (eval/exactness.py: it differs beyond a near-tie, a bug in verification)."""
    lines = [f"{name}: {error}" for name, error in r["errors"].items()]
    out_tol, grad_tol = r["config"]["kernel_tolerance"]
    for key, value in r.get("kernels", {}).items():
        for kind, tol in (("out", out_tol), ("grad", grad_tol)):
            if key.endswith(f"_{kind}_rel_diff") and not value <= tol:
                what = "output differs" if kind == "out" else "gradients differ"
                lines.append(f"kernels: {key.removesuffix(f'_{kind}_rel_diff')}'s {what} from eager's by {value:.2e} "
                             f"of the largest entry, over {tol:g} (--kernel-tolerance, KERNEL_TOLERANCE)")
    t = r.get("train", {})
    if t.get("losses_finite") is False:
        lines.append(f"train: a loss is not finite: {t['losses']}")
    for i, row in enumerate(r.get("decodes", {}).get("decodes", [])):
        if row["kind"] == "wrong":
            lines.append(f"decodes: decode {i + 1}'s speculative output differs from the autoregressive one at token "
                         f"{row['position']} beyond a near-tie (gap {row['logprob_gap']})")
    v = r.get("dflash2", {})
    for key, what in (("spec_vs_plain", "speculative output differs from its plain one"),
                      ("hf_vs_plain", "plain output differs from transformers' greedy one")):
        for i, row in enumerate(v.get(key) or []):
            if row["kind"] == "wrong":
                lines.append(f"dflash2: prompt {i + 1}: vLLM's {what} at token {row['position']} beyond a near-tie "
                             f"(gap {row['logprob_gap']})")
    return lines


def report(run: Run) -> int:
    """The summary, the failures (recorded, then one line each) and the exit code: 1 when any check failed."""
    r = run.results
    r["failures"] = failures(r)
    run.write()
    summary(r)
    for line in r["failures"]:
        print(f"FAILED {line}")
    return 1 if r["failures"] else 0


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
    v = r.get("dflash2", {})
    if "skipped" in v:
        print(f"dflash2: skipped, {v['skipped']}")
    elif "vllm" in v:
        def kinds(rows):
            return rows and {k: sum(x["kind"] == k for x in rows) for k in ("identical", "near_tie", "wrong")}

        tau = f"{v['tau']:.2f}" if "tau" in v else None
        print(f"dflash2 on vLLM {v['vllm']}: speculative vs plain {kinds(v.get('spec_vs_plain'))}, tau {tau}, "
              f"accepted per draft position {[round(x, 2) for x in v.get('acceptance_per_pos', [])]}; transformers "
              f"vs vLLM plain {kinds(v.get('hf_vs_plain'))}")
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
        if "dflash2" not in args.skip:  # it builds its own target: needs neither the build nor transformers' `cache=`
            with run.section("dflash2") as res:
                dflash2(run, res, args)
        return report(run)
    target = SimpleNamespace(model=model, eos_ids=set())
    if "costs" not in args.skip:
        with run.section("costs") as res:
            from dflash_pipeline.eval.policies import measure_costs

            drafter.to(dtype).eval()
            res.update(measure_costs(target, drafter, random_ids(args.context, drafter.config.mask_token_id, gen),
                                     BLOCK, repeats=args.cost_repeats, tree_sizes=TREE_SIZES))
    if "kernels" not in args.skip:
        with run.section("kernels") as res:
            kernels(run, res, drafter, args, gen)
    if "train" not in args.skip:
        with run.section("train") as res:
            train(run, res, model, drafter, args, dtype, gen)
        drafter.zero_grad(set_to_none=True)  # also after a failed step
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if "decodes" not in args.skip:
        with run.section("decodes") as res:
            drafter.to(dtype).eval()
            decodes(run, res, target, drafter, args, gen)
    if args.fsdp_procs is None and device.type == "cuda" and torch.cuda.device_count() > 1:
        args.fsdp_procs = torch.cuda.device_count()
    del model, drafter, target  # the fsdp processes and the dflash2 section build their own
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if args.fsdp_procs and args.fsdp_procs > 1 and "fsdp" not in args.skip:
        with run.section("fsdp") as res:
            fsdp(run, res, args)
    if "dflash2" not in args.skip:
        with run.section("dflash2") as res:
            dflash2(run, res, args)
    return report(run)


if __name__ == "__main__":
    sys.exit(main())
