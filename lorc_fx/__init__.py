"""lorc_fx: low-rank KV cache compression (LoRC) as a torch.compile pass."""
from .analysis import analyze
from .api import NoAttentionFound, compress, load_plan, plan, save_plan
from .cache import latent_cache
from .compile import lorc_backend
from .data.models import load_model, load_tokenizer
from .data.texts import load_text
from .plan import Plan, PlanOptions, UnreachableFraction
from .report import CompressionReport

__all__ = ["analyze", "plan", "lorc_backend", "compress", "latent_cache", "CompressionReport",
           "load_model", "load_tokenizer", "load_text", "Plan", "PlanOptions",
           "UnreachableFraction", "NoAttentionFound", "save_plan", "load_plan"]
