"""python -m data ... (or accelerate launch -m data ...): the same as dflash-teacher."""
from conf.entrypoints import teacher

teacher()
