"""Running a stage: its folder and config hash (whether its output is still valid), its progress bars (rates, ETA)
and its run logging (metrics.jsonl, wandb); used by every stage."""
