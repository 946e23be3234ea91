"""lorc_fx: low-rank KV cache compression (LoRC) as a torch.compile pass."""
from .api import plan
from .plan import Plan, PlanOptions
from .schedules import UnreachableFraction

__all__ = ["plan", "Plan", "PlanOptions", "UnreachableFraction"]
