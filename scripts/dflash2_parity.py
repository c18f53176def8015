"""DFlash2 parity with vLLM on CPU: one export's grouped convolutions and selector edge scores computed by this
project's modules and by vLLM's own (in vLLM's venv: bash scripts/setup_vllm.sh), plus the planted mismatches the
comparison must catch (eval/engine_parity.py).

    python scripts/dflash2_parity.py runs/<name>/train/selector/export [--blocks 3] [--seed 0]

Exit status 0 when the engine agrees within float32 rounding and every plant is caught.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from dflash_pipeline.eval.engine_parity import TOLERANCE, parity
from dflash_pipeline.models.vllm_engine import VLLMError


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("export", type=Path, help="a DFlash2DraftModel export folder")
    parser.add_argument("--blocks", type=int, default=3, help="blocks of random inputs per convolution")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache-dir", default=os.environ.get("DFLASH_CACHE", "~/.cache/dflash-pipeline"),
                        help="where scripts/setup_vllm.sh put vLLM's venv")
    args = parser.parse_args()
    try:
        result = parity(args.export, Path(args.cache_dir).expanduser(), args.blocks, args.seed)
    except (ValueError, VLLMError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"| check | {' | '.join(result['engine']['errors'])} | greedy walk | verdict |")
    print("|---" * (len(result["engine"]["errors"]) + 3) + "|")
    rows = [("vLLM's modules", result["engine"], "equal" if result["agrees"] else "DIFFERENT")]
    rows += [(f"planted: {name}", r, "caught" if result["caught"][name] else "NOT CAUGHT")
             for name, r in result["plants"].items()]
    for name, r, verdict in rows:
        errors = " | ".join(f"{e:.1e}" for e in r["errors"].values())
        print(f"| {name} | {errors} | {'same' if r['walk_equal'] else 'differs'} | {verdict} |")
    print(f"(max |ours - vLLM's| / max |vLLM's| per output, float32; tolerance {TOLERANCE:g})")
    return 0 if result["agrees"] and all(result["caught"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
