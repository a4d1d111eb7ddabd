"""Measuring this machine to tune a run: calibration of the simulator's cluster
description from timed kernels and collectives (:mod:`.calibrate`), and sweeps of short
real runs around a recipe (:mod:`.sweep`). Both start real processes; the analytic
planning they feed lives in :mod:`epscale.plan`."""
