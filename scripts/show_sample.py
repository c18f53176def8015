"""Show stored teacher samples as the target's tokenizer renders them: the check to make before a long training run
that the chat template, the turns and the generated-token mask are what your serving stack sends.

    python scripts/show_sample.py experiment=smollm2_quick hydra.run.dir=runs/smollm2_quick [--index 0 1]

Prints, per sample, its id, its token count, how many tokens are trained on (the target's own reply tokens), and the
text with every trained span between [[ and ]]. The run's teacher folder is `<hydra.run.dir>/<teacher.out_dir>`
(or `trainer.data_dir`); the tokenizer is the configured target's.
"""
from __future__ import annotations

import argparse

from dflash_pipeline.cli.entrypoints import compose_run
from dflash_pipeline.data.shards import TeacherDataset
from dflash_pipeline.models.target_sources import load_tokenizer
from dflash_pipeline.runtime.stages import teacher_dir


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--index", type=int, nargs="+", default=[0], help="sample positions in the dataset")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides: experiment=... hydra.run.dir=<run folder>")
    return ap


def render(tokenizer, ids: list[int], mask: list[bool]) -> str:
    """The sample's text with each run of trained tokens (mask true) between [[ and ]]."""
    out, start = [], 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or mask[i] != mask[start]:
            text = tokenizer.decode(ids[start:i])
            out.append(f"[[{text}]]" if mask[start] else text)
            start = i
    return "".join(out)


def main() -> None:
    args = build_parser().parse_args()
    cfg = compose_run(args.overrides)
    folder = teacher_dir(cfg, cfg.hydra.run.dir)
    data = TeacherDataset(folder)
    tokenizer = load_tokenizer(cfg.target, cfg.cache_dir)
    for i in args.index:
        item = data[i]
        ids, mask = item["input_ids"].tolist(), item["loss_mask"].tolist()
        print(f"== sample {i} ({item['id']}): {len(ids)} tokens, {sum(mask)} trained on ==")
        print(render(tokenizer, ids, mask))


if __name__ == "__main__":
    main()
