"""python -m dflash_pipeline.train ... (or accelerate launch -m dflash_pipeline.train ...): the same as dflash-train."""
from dflash_pipeline.cli.entrypoints import train

train()
