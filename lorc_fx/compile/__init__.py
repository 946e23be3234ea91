"""The compile stage: the graph passes behind one pass manager, the absorbed latent
attention they rewrite to, and the ``lorc_backend`` that runs them before Inductor."""
from .backend import LorcBackend, lorc_backend
from .pass_manager import LorcPassManager, PassReport

__all__ = ["LorcBackend", "LorcPassManager", "PassReport", "lorc_backend"]
