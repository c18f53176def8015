"""Served acceptance at temperature: the own loop under both acceptance rules beside vLLM (seeded, unseeded,
batched), as installed and with its known CPU bug mended, at several temperatures (docs/results/vllm.md, 'At
temperature').

    python scripts/served_temperature.py --run-dir <a trained run> [--temperatures 0.3 0.7 1.0] [--prompts 4]
        [--seeds 3] [--max-new-tokens 48] [--probabilistic-at 0.7] [--out served_temperature.json] [hydra overrides ...]

The run dir's .hydra/config.yaml gives the target and the drafter (<run dir>/<trainer.out_dir>/export); the prompts
are the first MT-Bench turns, as the eval stage renders them. Prints one table row per temperature and run kind,
and each gate's line; writes every figure and decode count to --out.
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

from dflash_pipeline.eval import served as served_eval
from dflash_pipeline.eval.engines import VLLMPair
from dflash_pipeline.eval.decode import ACCEPTANCE_RULES
from dflash_pipeline.eval.references import ReferenceCache
from dflash_pipeline.eval.inputs import load_drafter, load_prompts
from dflash_pipeline.models.target import load_target
from dflash_pipeline.models.target_sources import target_folder
from dflash_pipeline.runtime.stages import stage_dir


def _f(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run-dir", required=True, help="a run folder with .hydra/config.yaml and a trained export")
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.3, 0.7, 1.0])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--probabilistic-at", type=float, nargs="*", default=[0.7],
                    help="the temperatures that also serve with draft_sample_method=probabilistic (repaired)")
    ap.add_argument("--alpha", type=float, default=0.01, help="the gate's family-wise level")
    ap.add_argument("--out", default="served_temperature.json")
    ap.add_argument("overrides", nargs="*", help="dotted config overrides (key=value)")
    args = ap.parse_args()
    run = Path(args.run_dir)
    if not (run / ".hydra" / "config.yaml").is_file():
        raise SystemExit(f"error: no {run}/.hydra/config.yaml: pass the folder of a finished dflash-pipeline run")
    cfg = OmegaConf.merge(OmegaConf.load(run / ".hydra" / "config.yaml"), OmegaConf.from_dotlist(args.overrides))
    cfg.eval.num_prompts, cfg.eval.turns, cfg.eval.max_new_tokens = args.prompts, 1, args.max_new_tokens
    torch.set_num_threads(args.threads)
    target = load_target(cfg.target, cfg.cache_dir)
    drafter, drafter_dir = load_drafter(cfg, stage_dir(cfg, "train", run), target)
    room = target.config.max_position_embeddings - args.max_new_tokens
    prompts = [p["prompt_ids"] for p in load_prompts("mtbench", "mtbench", cfg, ReferenceCache(
        Path(cfg.cache_dir) / "references", target), room)["mtbench"]]
    B = drafter.config.block_size
    seeds = list(range(args.seeds))
    folder = target_folder(cfg.target, cfg.cache_dir)
    log_file = Path(cfg.cache_dir) / "vllm" / "served_temperature.log"
    log_file.parent.mkdir(parents=True, exist_ok=True)
    report = {"machine": platform.processor() or platform.machine(), "threads": args.threads, "prompts": len(prompts),
              "seeds": seeds, "max_new_tokens": args.max_new_tokens, "drafter": str(drafter_dir), "runs": {}}
    print(f"{'T':>4} {'run':<28} {'decodes':>7} {'drafts':>6}  {'tau [95%]':<22} a_1 [95%] / a_2 / a_3")
    for T in args.temperatures:
        t0 = time.perf_counter()
        own = {r: served_eval.own_sampled(target, drafter, prompts, B, args.max_new_tokens, T, seeds, r)
               for r in ACCEPTANCE_RULES}
        engines = [("greedy", "greedy", False), ("greedy_repaired", "greedy", True)]
        if T in args.probabilistic_at:
            engines.append(("probabilistic_repaired", "probabilistic", True))
        for name, method, repair in engines:
            engine = VLLMPair(cfg.cache_dir, folder, drafter_dir, target.dtype, B,
                              target.config.max_position_embeddings, args.threads, log_file,
                              plain=False, draft_sample_method=method, repair=repair)
            try:
                res = served_eval.sampled_set(engine, target, drafter, prompts, B, args.max_new_tokens, T, seeds,
                                              len(prompts), args.alpha, method, name, own)
            finally:
                engine.close()
            report["runs"][f"{T}/{name}"] = res
            for kind, t in res["rates"].items():
                if kind.startswith("own") and name != "greedy":
                    continue
                a = " / ".join(_f(x["rate"]) + (f" [{_f(x['low'])}, {_f(x['high'])}]" if i == 0 else "")
                               for i, x in enumerate(t["a_k"][:3]))
                label = kind if kind.startswith("own") else f"{name}: {kind}"
                print(f"{T:>4} {label:<28} {t['decodes']:>7} {t['drafts']:>6}  {t['tau']:.3f} [{_f(t['tau_low'])}, "
                      f"{_f(t['tau_high'])}]   {a}", flush=True)
            print(f"     gate ({name}): {res['gate']['line']}", flush=True)
            print(f"     PIT chi-square p: served {res['distribution']['served']['p']}, own "
                  f"{res['distribution']['own']['p']}; seeded vs unseeded differ at "
                  f"{res['seeded_vs_unseeded']['differ'] or 'no position'}", flush=True)
        print(f"     ({time.perf_counter() - t0:.0f} s)", flush=True)
    tmp = Path(args.out).with_suffix(".tmp")
    tmp.write_text(json.dumps(report, indent=1, default=str))
    tmp.rename(args.out)


if __name__ == "__main__":
    main()
