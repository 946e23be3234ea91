"""lorc_fx: low-rank KV cache compression (LoRC) as a torch.compile pass."""
from .analysis import analyze
from .api import plan
from .backend import lorc_backend
from .compress import CompressionReport, compress, latent_cache
from .models import load_model, load_tokenizer
from .plan import Plan, PlanOptions
from .schedules import UnreachableFraction
from .texts import load_text

__all__ = ["analyze", "plan", "lorc_backend", "compress", "latent_cache", "CompressionReport",
           "load_model", "load_tokenizer", "load_text", "Plan", "PlanOptions",
           "UnreachableFraction"]
