"""Benchmark: llama.cpp's plain decoding against the same server with a trained drafter, side by side in one run.

    python scripts/bench_llamacpp.py --run runs/<a run with a full-vocabulary drafter> [--threads 1 2]
        [--exports <export> ...] [--target embedded|f32] [--drafter-type f32 f16] [--untrained]
        [--shaped smollm2_1.7b] [--set target.path=...] [--omp-wait passive active default] [--prompts 6]
        [--max-new-tokens 64] [--repeats 3] [--json out.json]

The target is the run's: `embedded` serves the GGUF the target was loaded from (the embedded SmolLM2 is Q4_1), `f32`
its float32 folder converted by llama.cpp's converter; --shaped a larger SmolLM2's shapes with random weights (the
cost of a round at that size, with an untrained drafter: acceptance is meaningless there). The drafters are the
run's export, or the --exports given (drafters of the same target: a DFlash export, a DFlash2 selector's checkpoint),
each converted with the target's folder (models/llamacpp_engine.py). --omp-wait sets both servers'
OMP_WAIT_POLICY, each in turn (`default`: OpenMP's own). Prompts: the first MT-Bench turns in the target's chat
template. Per thread count, a plain and a speculative llama-server (one slot, one request at a time) run the prompts
in the order plain, spec, spec, plain x --repeats after a warm-up; tokens/s is the median over requests of reply
tokens / wall time, the ratio spec / plain of those medians, tau and a_k from llama.cpp's own counters, and the
break-even tau: a round's time in plain steps (tau x plain / spec), the tau above which the drafter would pay.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
from pathlib import Path

from omegaconf import OmegaConf


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", type=Path, required=True, help="a run folder (its .hydra/config.yaml and train/export)")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--target", choices=["embedded", "f32"], default="embedded")
    ap.add_argument("--drafter-type", nargs="+", default=["f32", "f16"], choices=["f32", "f16"])
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--exports", type=Path, nargs="+",
                    help="drafter exports to serve, side by side (default: the run's train/export); a DFlash2 "
                         "selector's checkpoint is train/selector/export")
    ap.add_argument("--omp-wait", nargs="+", default=["default"], choices=["passive", "active", "default"],
                    help="OMP_WAIT_POLICY of both servers, each measured in turn (`default`: leave it to OpenMP)")
    ap.add_argument("--untrained", action="store_true",
                    help="serve a randomly initialised full-vocabulary DFlash drafter of the run's shape instead: what "
                         "a round costs on the target whatever the acceptance (a target no drafter was trained for)")
    ap.add_argument("--shaped", choices=sorted(SHAPED),
                    help="serve a Llama target of a larger SmolLM2's shapes with random weights (with the run's "
                         "tokenizer), converted to GGUF --shaped-type, and an untrained drafter: the costs of a round "
                         "at that size (implies --untrained; acceptance is meaningless there)")
    ap.add_argument("--shaped-type", default="q8_0", choices=["f16", "q8_0"])
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="overrides of the run's config, e.g. target.path=... target.gguf_file=... (another GGUF "
                         "target, with --untrained)")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()

    from dflash_pipeline.eval.inputs import load_prompts
    from dflash_pipeline.eval.references import ReferenceCache
    from dflash_pipeline.eval.gates import rates, summed
    from dflash_pipeline.models import llamacpp_engine as L
    from dflash_pipeline.models.target import load_target
    from dflash_pipeline.models.target_sources import gguf_source, target_folder
    from dflash_pipeline.runtime.stages import export_dir, recorded_stage_dir

    cfg = OmegaConf.merge(OmegaConf.load(a.run / ".hydra" / "config.yaml"), OmegaConf.from_dotlist(a.set))
    if a.shaped:
        shaped = shaped_target(a.shaped, target_folder(cfg.target, cfg.cache_dir), Path(cfg.cache_dir))
        cfg.target = OmegaConf.merge(cfg.target, {"kind": "hf", "path": str(shaped), "gguf_file": None})
        a.untrained = True
    target = load_target(cfg.target, cfg.cache_dir)
    folder = target_folder(cfg.target, cfg.cache_dir)
    out_dir = Path(cfg.cache_dir) / "llamacpp" / "gguf"
    exports = ([untrained(cfg, target, out_dir)] if a.untrained
               else a.exports or [export_dir(recorded_stage_dir(a.run, "train"))])
    block = json.loads((exports[0] / "config.json").read_text())["block_size"]
    if a.shaped:
        target_gguf = L.to_gguf(cfg.cache_dir, folder, out_dir, a.shaped_type)
    elif a.target == "embedded":
        if cfg.target.kind != "gguf":
            sys.exit(f"--target embedded: the run's target is not a GGUF ({cfg.target.kind}); use --target f32")
        target_gguf = gguf_source(cfg.target.path, cfg.target.gguf_file)
    else:
        target_gguf = L.to_gguf(cfg.cache_dir, folder, out_dir, "f32")

    def label(i: int, export: Path) -> str:  # <run>/train/export -> run, <run>/train/selector/export -> run/selector
        parts = [p for p in export.resolve().parts[-4:] if p not in ("train", "export")]
        return f"{i + 1}:{'/'.join(parts[-2:])}"

    drafters = {f"{label(i, e)} {t}" if len(exports) > 1 else t:
                L.to_gguf(cfg.cache_dir, e, out_dir, t, target_dir=folder)
                for i, e in enumerate(exports) for t in a.drafter_type}
    cfg.eval.num_prompts = a.prompts
    if target.tokenizer.chat_template:
        prompts = [p["prompt_ids"] for p in load_prompts("mtbench", "mtbench", cfg,
                                                        ReferenceCache(cfg.cache_dir, target), 1024)["mtbench"]]
    else:  # a base model: the questions as plain text
        prompts = [target.tokenizer(q).input_ids for q in mtbench_questions()]
    prompts = prompts[: a.prompts]
    eos = sorted(target.eos_ids)
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").is_file() else ""
    print(f"# {cpu}; target {target_gguf.name}; {len(prompts)} MT-Bench prompts x {a.max_new_tokens} tokens, "
          f"block {block}\n")
    # a round yields tau tokens in tau / spec tok/s: it pays when tau exceeds that time in plain steps
    print("| OMP wait | threads | drafter | plain tok/s | spec tok/s | spec / plain | tau | break-even tau | "
          "a_1 / a_2 / a_3 |")
    print("|---|---|---|---|---|---|---|---|---|", flush=True)
    rows = []
    for wait, threads in ((w, t) for w in a.omp_wait for t in a.threads):
        policy = None if wait == "default" else wait
        plain = L.LlamaServer(cfg.cache_dir, target_gguf, threads=threads, ctx=2048, block_size=block,
                              omp_wait=policy)
        try:
            for kind, drafter in drafters.items():
                with L.LlamaServer(cfg.cache_dir, target_gguf, drafter, block_size=block, threads=threads,
                                   ctx=2048, omp_wait=policy) as spec:
                    for server in (plain, spec):
                        server.generate(prompts[:1], a.max_new_tokens, eos)  # warm-up
                    times = {"plain": [], "spec": []}
                    counters = []
                    for _ in range(a.repeats):
                        for p in prompts:
                            for name, server in (("plain", plain), ("spec", spec), ("spec", spec), ("plain", plain)):
                                res = server.generate([p], a.max_new_tokens, eos)
                                times[name].append(len(res["outputs"][0]) / res["seconds"][0])
                                if name == "spec":
                                    counters.append(res["spec"][0])
                plain_tps, spec_tps = statistics.median(times["plain"]), statistics.median(times["spec"])
                r = rates(summed(counters, block - 1))
                row = {"omp_wait": wait, "threads": threads, "drafter": kind, "plain_tok_s": plain_tps,
                       "spec_tok_s": spec_tps, "ratio": spec_tps / plain_tps, "tau": r["tau"],
                       "break_even_tau": r["tau"] * plain_tps / spec_tps, "a_k": r["a_k"]}
                rows.append(row)
                print(f"| {wait} | {threads} | {kind} | {plain_tps:.1f} | {spec_tps:.1f} | {row['ratio']:.2f}x | "
                      f"{r['tau']:.3f} | {row['break_even_tau']:.2f} | {' / '.join(f'{x:.2f}' for x in r['a_k'][:3])} |", flush=True)
        finally:
            plain.close()
    if a.json:
        a.json.write_text(json.dumps({"cpu": cpu, "target": str(target_gguf), "rows": rows}, indent=1))


SHAPED = {  # SmolLM2's larger sizes (Llama architecture, its 49,152-token vocabulary, tied embeddings)
    "smollm2_360m": dict(hidden_size=960, intermediate_size=2560, num_attention_heads=15, num_key_value_heads=5,
                         num_hidden_layers=32),
    "smollm2_1.7b": dict(hidden_size=2048, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=32,
                         num_hidden_layers=24),
}


def shaped_target(name: str, tokenizer_dir: Path, cache: Path) -> Path:
    """A Llama model folder of SHAPED[name] with random weights (std 0.02, seed 0, bfloat16) and the tokenizer of
    `tokenizer_dir`, made once under <cache>/targets/ (temporary name, then renamed)."""
    import shutil

    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    out = cache / "targets" / f"shaped-{name}"
    if (out / "config.json").is_file():
        return out
    from dflash_pipeline.runtime.files import publish_folder

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = LlamaConfig(**SHAPED[name], vocab_size=len(tok), tie_word_embeddings=True, rope_theta=130000.0,
                         max_position_embeddings=8192, rms_norm_eps=1e-5, initializer_range=0.02,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, torch_dtype="bfloat16")
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    return publish_folder(tmp, out)


def untrained(cfg, target, out_dir: Path) -> Path:
    """A randomly initialised full-vocabulary DFlash drafter of the run's drafter shape for `target` (seed 0), its
    taps spread as the teacher would tap them: an export that serves at the trained drafter's cost."""
    import torch

    from dflash_pipeline.models.drafter import DFlashDrafter
    from dflash_pipeline.models.families import default_layer_ids
    from dflash_pipeline.train.drafter import drafter_config

    m = target.model
    ids = default_layer_ids(m.config.num_hidden_layers, cfg.teacher.num_taps)
    cfg.drafter.conv_kernel_size, cfg.trainer.draft_vocab_size = 0, None
    torch.manual_seed(0)
    drafter = DFlashDrafter(drafter_config(cfg, target, ids), m.get_input_embeddings(), m.get_output_embeddings())
    folder = out_dir / f"untrained-{Path(str(cfg.target.gguf_file or cfg.target.path)).name}"
    drafter.save_pretrained(str(folder))
    return folder


def mtbench_questions() -> list[str]:
    """MT-Bench's first turns, as the data layer reads them."""
    from dflash_pipeline.data.sources import _read

    return [c["messages"][0]["content"] for c in _read("mtbench", None, None, None)]


if __name__ == "__main__":
    main()
