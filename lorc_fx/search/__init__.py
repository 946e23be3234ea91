"""The plan search (``planning``): every registered storage scheme offers candidates for the
budget (``context``, ``candidates``), each measured through the real latent cache on held-out
calibration windows (``windows`` runs them through it); and what those measurements need:
the calibrated schedule's key/value split (``split``), the vector scheme's codebooks
(``codebooks``), the smallest fraction within a quality target (``fraction``). Above
``cache`` and ``plan``, since it runs candidate plans through the cache; below the schemes,
which plan their candidates with it."""
