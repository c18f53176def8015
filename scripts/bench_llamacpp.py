"""Benchmark: llama.cpp's plain decoding against the same server with a trained drafter, side by side in one run.

    python scripts/bench_llamacpp.py --run runs/<a run with a full-vocabulary drafter> [--threads 1 2]
                                     [--exports <export> ...] [--target embedded|f32] [--drafter-type f32 f16]
                                     [--omp-wait passive active] [--prompts 6] [--max-new-tokens 64] [--repeats 3]
                                     [--json out.json]

The target is the run's: `embedded` serves the GGUF the target was loaded from (the embedded SmolLM2 is Q4_1), `f32`
its float32 folder converted by llama.cpp's converter. The drafters are the run's export, or the --exports given
(drafters of the same target: a DFlash export, a DFlash2 selector's checkpoint), each converted with the target's
folder (models/llamacpp_engine.py). --omp-wait sets both servers' OMP_WAIT_POLICY, each in turn. Prompts: the first MT-Bench turns in the target's chat template. Per thread
count, a plain and a speculative llama-server (one slot, one request at a time) run the prompts in the order plain,
spec, spec, plain x --repeats after a warm-up; tokens/s is the median over requests of reply tokens / wall time,
the ratio spec / plain of those medians, tau and a_k from llama.cpp's own counters.
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
    ap.add_argument("--omp-wait", nargs="+", default=["passive"], choices=["passive", "active"],
                    help="OMP_WAIT_POLICY of both servers, each measured in turn")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()

    from dflash_pipeline.eval.inputs import load_prompts
    from dflash_pipeline.eval.references import ReferenceCache
    from dflash_pipeline.eval.served import rates, summed
    from dflash_pipeline.models import llamacpp_engine as L
    from dflash_pipeline.models.target import _gguf_source, load_target, target_folder

    cfg = OmegaConf.load(a.run / ".hydra" / "config.yaml")
    exports = a.exports or [a.run / "train" / "export"]
    block = json.loads((exports[0] / "config.json").read_text())["block_size"]
    target = load_target(cfg.target, cfg.cache_dir)
    folder = target_folder(cfg.target, cfg.cache_dir)
    out_dir = Path(cfg.cache_dir) / "llamacpp" / "gguf"
    if a.target == "embedded":
        if cfg.target.kind != "gguf":
            sys.exit(f"--target embedded: the run's target is not a GGUF ({cfg.target.kind}); use --target f32")
        target_gguf = _gguf_source(cfg.target.path, cfg.target.gguf_file)
    else:
        target_gguf = L.to_gguf(cfg.cache_dir, folder, out_dir, "f32")
    def label(export: Path) -> str:  # <run>/train/export -> run, <run>/train/selector/export -> run/selector
        parts = export.resolve().parts
        return parts[-3] if parts[-2] == "train" else f"{parts[-4]}/{parts[-2]}"

    drafters = {f"{label(e)} {t}" if len(exports) > 1 else t: L.to_gguf(cfg.cache_dir, e, out_dir, t, target_dir=folder)
                for e in exports for t in a.drafter_type}
    cfg.eval.num_prompts = a.prompts
    prompts = [p["prompt_ids"] for p in load_prompts("mtbench", "mtbench", cfg, ReferenceCache(cfg.cache_dir, target),
                                                    1024)["mtbench"]][: a.prompts]
    eos = sorted(target.eos_ids)
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").is_file() else ""
    print(f"# {cpu}; target {target_gguf.name}; {len(prompts)} MT-Bench prompts x {a.max_new_tokens} tokens, "
          f"block {block}\n")
    print("| OMP wait | threads | drafter | plain tok/s | spec tok/s | spec / plain | tau | a_1 / a_2 / a_3 |")
    print("|---|---|---|---|---|---|---|---|", flush=True)
    rows = []
    for wait, threads in ((w, t) for w in a.omp_wait for t in a.threads):
        os.environ["OMP_WAIT_POLICY"] = wait  # LlamaServer keeps the caller's
        plain = L.LlamaServer(cfg.cache_dir, target_gguf, threads=threads, ctx=2048, block_size=block)
        try:
            for kind, drafter in drafters.items():
                with L.LlamaServer(cfg.cache_dir, target_gguf, drafter, block_size=block, threads=threads,
                                   ctx=2048) as spec:
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
                row = {"omp_wait": wait, "threads": threads, "drafter": kind, "plain_tok_s": plain_tps, "spec_tok_s": spec_tps,
                       "ratio": spec_tps / plain_tps, "tau": r["tau"], "a_k": r["a_k"]}
                rows.append(row)
                print(f"| {wait} | {threads} | {kind} | {plain_tps:.1f} | {spec_tps:.1f} | {row['ratio']:.2f}x | "
                      f"{r['tau']:.3f} | {' / '.join(f'{x:.2f}' for x in r['a_k'][:3])} |", flush=True)
        finally:
            plain.close()
    if a.json:
        a.json.write_text(json.dumps({"cpu": cpu, "target": str(target_gguf), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
