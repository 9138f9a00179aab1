"""fuseformer: fused Triton kernels, an inference engine and a trainer for PyTorch Transformers.

Public API: ``fuseformer.ops`` (the fused ops), ``use_backend`` (force a backend for a block).
"""

from fuseformer import ops
from fuseformer.runtime.backend import use_backend

__version__ = "0.1.0"

__all__ = ["ops", "use_backend", "__version__"]
