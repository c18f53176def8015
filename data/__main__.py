"""python -m dflash_pipeline.data ... (or accelerate launch -m dflash_pipeline.data ...): the same as dflash-teacher."""
from dflash_pipeline.cli.entrypoints import teacher

teacher()
