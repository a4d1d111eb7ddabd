"""Planning a run without running it (torch-free: numpy and the config only): the layout
of the process world (:mod:`.layout`), model sizes and FLOPs (:mod:`.sizing`), the memory
per rank (:mod:`.memory`), the pipeline split and schedule tables (:mod:`.pipeline`), the
step model of the cluster simulator with its cluster descriptions (:mod:`.cluster`),
routing distributions (:mod:`.routing`), balancing strategies (:mod:`.balance`, with the
placement planners of :mod:`.placement`) and the search for layouts that fit
(:mod:`.fit`). Simulating 1,024 GPUs takes well under a second per (strategy, dispatcher)
pair. ``describe``, ``simulate``, ``slurm``, elastic restarts and the trainer read it."""

from .cluster import PRESETS, ClusterSpec, load_cluster
from .step_model import SimResult, simulate

__all__ = ["ClusterSpec", "PRESETS", "load_cluster", "SimResult", "simulate"]
