"""The storage schemes, one module each, registered in the order the search measures them
(``lorc_fx.plan.scheme.SCHEMES``): plain quantization first (it needs no calibration, and
a candidate within noise of the full cache ends the search), then keys water-filled and
vector codes, then low rank at every RoPE mode and width. A new scheme is one module that
defines a ``Scheme`` and registers it, plus one import here."""
from . import plain  # noqa: F401
from . import keys_waterfilled  # noqa: F401
from . import vector  # noqa: F401
from . import low_rank  # noqa: F401
