"""nn.Modules built on the fused ops: they hold parameters and call the op, nothing more."""

from fuseformer.layers.activations import GeGLU, SwiGLU

__all__ = ["GeGLU", "SwiGLU"]
