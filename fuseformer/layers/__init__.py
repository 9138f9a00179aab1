"""nn.Modules built on the fused ops: they hold parameters and call the op, nothing more."""

from fuseformer.layers.activations import GeGLU, SwiGLU
from fuseformer.layers.attention import Attention
from fuseformer.layers.linear import Linear
from fuseformer.layers.mlp import GatedMLP
from fuseformer.layers.norms import LayerNorm, RMSNorm
from fuseformer.layers.rotary import RotaryEmbedding

__all__ = ["Attention", "GatedMLP", "GeGLU", "LayerNorm", "Linear", "RMSNorm", "RotaryEmbedding", "SwiGLU"]
