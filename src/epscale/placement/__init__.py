"""Expert placement: redundant experts (EPLB-style) and least-loaded spill-over (LLEP)."""

from .eplb import Placement, plan_placement, round_robin_placement

__all__ = ["Placement", "plan_placement", "round_robin_placement"]
