"""python -m dflash_pipeline.data ... (or accelerate launch -m dflash_pipeline.data ...): the same as dflash-teacher."""
from dflash_pipeline.conf.entrypoints import teacher

teacher()
