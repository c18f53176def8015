"""python -m dflash_pipeline.cli.producer <resolved config.yaml> <run dir> <teacher dataset>: the feature producer
a trainer starts itself (producer.launch=true: data/producer.py launch), with the config the trainer resolved. A
user starts one with dflash-producer and the run's overrides instead."""
from __future__ import annotations

import argparse
import logging
import sys

from omegaconf import OmegaConf


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config", help="the resolved config the trainer saved (producer-config.yaml)")
    ap.add_argument("run_dir", help="the run folder whose spool the producer fills")
    ap.add_argument("data_dir", help="the teacher dataset the drafter stage reads")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    from dflash_pipeline.data.producer import run_producer
    from dflash_pipeline.data.shards import DatasetError
    from dflash_pipeline.models.vllm_engine import VLLMError

    try:
        run_producer(OmegaConf.load(args.config), args.run_dir, args.data_dir)
    except (DatasetError, VLLMError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
