"""Cluster-scale model of one MoE training step: cluster descriptions (:mod:`.cluster`),
routing distributions (:mod:`.routing`), balancing strategies (:mod:`.balance`) and the
step model itself (:mod:`.step_model`). Everything is numpy and analytic: simulating
1,024 GPUs takes well under a second per (strategy, dispatcher) pair."""

from .cluster import PRESETS, ClusterSpec, load_cluster
from .step_model import SimResult, simulate

__all__ = ["ClusterSpec", "PRESETS", "load_cluster", "SimResult", "simulate"]
