"""Expert placement: redundant experts (EPLB-style) and least-loaded spill-over (LLEP),
the planners (``eplb``, ``llep``) and their run time (``replicas``, ``spill``). A
placement is applied by ``epscale.parallelize(module, dims, placement=plan)``."""

from .eplb import Placement, plan_placement, round_robin_placement
from .llep import SpillPlan, plan_spill
from .replicas import (PlacedDispatcher, Rebalancer, get_placement, move_to_placement,
                       sync_replica_gradients)
from .spill import SpillDispatcher, apply_spill

__all__ = ["Placement", "plan_placement", "round_robin_placement", "SpillPlan", "plan_spill",
           "PlacedDispatcher", "Rebalancer", "get_placement",
           "move_to_placement", "sync_replica_gradients", "SpillDispatcher", "apply_spill"]
