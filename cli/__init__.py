"""The command line: the console scripts over conf/config.yaml, the stage runner, and launch set-up (SLURM,
accelerate, sweep locks); the measurement scripts' shared argument parser."""
