"""lorc_fx: KV cache compression (plain quantization, low-rank latents (LoRC), water-filled
keys, vector codes) as a torch.compile pass."""
from .analysis import analyze
from .api import NoAttentionFound, compress, load_plan, plan, save_plan
from .cache import latent_cache
from .compile import lorc_backend
from .data.models import load_model, load_tokenizer
from .data.texts import load_text
from .plan import CalibrationOptions, Plan, PlanOptions, UnreachableFraction
from .report import CompressionReport

__all__ = ["analyze", "plan", "lorc_backend", "compress", "latent_cache", "CompressionReport",
           "load_model", "load_tokenizer", "load_text", "Plan", "PlanOptions", "CalibrationOptions",
           "UnreachableFraction", "NoAttentionFound", "save_plan", "load_plan"]
