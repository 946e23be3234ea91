"""Choices measured through the real latent cache on held-out calibration windows (which
``windows`` runs through it): the calibrated schedule's key/value split (``split``), the bit
search's candidates (``bits``), the water-filled keys' rounding errors (``key_bits``), the
smallest fraction within a quality target (``fraction``). Above ``cache`` and ``plan``, since
it runs candidate plans through the cache."""
