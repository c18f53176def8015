"""python -m train ... (or accelerate launch -m train ...): the same as dflash-train."""
from conf.entrypoints import train

train()
