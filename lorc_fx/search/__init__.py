"""Choices measured through the real latent cache on held-out calibration windows: the
calibrated schedule's key/value split (``split``). Above ``cache`` and ``plan``, since it runs
candidate plans through the cache."""
