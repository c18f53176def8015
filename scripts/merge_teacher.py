"""Merge finished teacher datasets into one (symbolic links, no copies), e.g. a regenerated run and a prefilled
run into a mixture, or two regenerated runs of disjoint prompts (data.skip) into a larger dataset:

    python scripts/merge_teacher.py runs/smollm2_ref/teacher runs/prefill/teacher --out runs/mixed_teacher
    dflash-train experiment=smollm2_ref trainer.data_dir=runs/mixed_teacher

Held-out splits take regenerated samples first, so a mixture is scored on the target's own replies.
"""
from __future__ import annotations

import argparse
import sys

from dflash_pipeline.data.shards import DatasetError, merge_datasets


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sources", nargs="+", help="finished teacher dataset folders")
    ap.add_argument("--out", required=True, help="the merged dataset's folder (new)")
    args = ap.parse_args()
    try:
        out = merge_datasets(args.sources, args.out)
    except DatasetError as e:
        sys.exit(f"error: {e}")
    print(f"merged {len(args.sources)} teacher datasets -> {out}")


if __name__ == "__main__":
    main()
