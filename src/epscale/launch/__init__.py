"""Launching training and surviving faults.

- :mod:`epscale.launch.local`: ``epscale launch --nproc N CONFIG`` (torchrun on one machine,
  restarts after a rank dies).
- :mod:`epscale.launch.slurm`: ``epscale slurm render|submit`` (sbatch scripts: srun torchrun,
  c10d rendezvous, requeue, checkpoint before the time limit).
- :mod:`epscale.launch.agent`: torchrun that forwards SIGUSR1 to its workers.
- :mod:`epscale.launch.preflight`: a short timed all-reduce/all-to-all check of every rank.
- :mod:`epscale.launch.watchdog`: hung-collective timeout with a per-rank flight recorder.

Submodules are imported on use (``from epscale.launch.preflight import run_preflight``) so
that rendering a script does not import torch.
"""
