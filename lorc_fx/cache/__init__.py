"""The latent KV cache: custom ops, one latent cache layer per allocation (dynamic, static)
holding a store per side (``stores``: floats, integer codes, vector codes), the RoPE angle
log, and installing a plan's cache into a model's ``generate``."""
from .install import angles_handed, install, latent_cache
from .latent_cache import (LatentCache, codecs, layers_kept_as_built, replaceable,
                           sliding_windows)
from .own_layers import codes_own_states
from .layers import (LatentCodec, LatentDynamicLayer, LatentSlidingLayer, LatentStaticLayer,
                     LatentStaticSlidingLayer)

__all__ = ["LatentCache", "LatentCodec", "LatentDynamicLayer", "LatentSlidingLayer",
           "LatentStaticLayer", "LatentStaticSlidingLayer", "angles_handed", "codecs",
           "codes_own_states",
           "install", "latent_cache", "layers_kept_as_built", "replaceable", "sliding_windows"]
