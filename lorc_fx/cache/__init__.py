"""The latent KV cache: custom ops, latent cache layers, the RoPE angle log, and installing
a plan's cache into a model's ``generate``."""
from .install import angles_handed, install, latent_cache
from .latent_cache import LatentCache, codecs, layers_kept_as_built
from .layers import LatentCodec

__all__ = ["LatentCache", "LatentCodec", "angles_handed", "codecs", "install", "latent_cache",
           "layers_kept_as_built"]
