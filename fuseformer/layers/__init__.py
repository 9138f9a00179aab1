"""nn.Modules built on the fused ops: they hold parameters and call the op, nothing more."""
