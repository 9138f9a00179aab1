"""RMSNorm and LayerNorm modules on the fused ops, drop-in for their torch and Hugging Face twins.

Parameters are named as in ``torch.nn.RMSNorm`` / ``torch.nn.LayerNorm`` / HF ``LlamaRMSNorm``
(``weight``, ``bias``), so their state dicts load as they are; ``from_module`` builds one sharing
the parameters of an existing module (the fusion pass uses it to replace instances in place).

``forward(x, residual=None)`` returns y, or ``(y, x + residual)`` when a residual is given: the
add before the norm is fused into the kernel and the sum comes back as the new residual stream.
The kernels normalize over one trailing dim only, so ``normalized_shape`` must be one int.
"""

from __future__ import annotations

import torch
from torch import nn

import fuseformer.ops as F


def _single_dim(cls: str, normalized_shape: int | tuple[int, ...] | list[int] | torch.Size) -> int:
    """``n`` or ``(n,)`` -> n; anything else (several dims, not an int) is a ValueError."""
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else normalized_shape
    try:
        shape = tuple(shape)
    except TypeError:
        raise ValueError(f"{cls}: normalized_shape must be an int or a 1-tuple, got {normalized_shape!r}") from None
    if len(shape) != 1 or isinstance(shape[0], bool) or not isinstance(shape[0], int) or shape[0] < 0:
        raise ValueError(
            f"{cls}: normalized_shape must be one non-negative int (the kernels normalize over the last "
            f"dim only), got {normalized_shape!r}"
        )
    return shape[0]


def _check_eps(cls: str, eps: object, allow_none: bool = False) -> None:
    if eps is None and allow_none:
        return
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"{cls}: eps must be a non-negative float, got {eps!r}")


def _check_last_dim(cls: str, x: torch.Tensor, n: int) -> None:
    # Without a weight the op cannot see the expected size; check here so a wrong input fails.
    if isinstance(x, torch.Tensor) and (x.dim() == 0 or x.shape[-1] != n):
        raise ValueError(f"{cls}: x has shape {tuple(x.shape)}; expected a last dim of {n}")


def _eps_of(cls: str, m: nn.Module) -> float | None:
    """A norm module's epsilon: ``variance_epsilon`` (HF) or ``eps`` (torch)."""
    for name in ("variance_epsilon", "eps"):
        if hasattr(m, name):
            return getattr(m, name)
    raise ValueError(f"{cls}.from_module: {type(m).__name__} has neither `variance_epsilon` nor `eps`")


def _shared_param(cls: str, m: nn.Module, name: str, n: int) -> nn.Parameter | None:
    """``m.<name>`` (an nn.Parameter of shape (n,), or None) to be shared, checked."""
    p = getattr(m, name, None)
    if p is None:
        return None
    if not isinstance(p, nn.Parameter):
        raise ValueError(
            f"{cls}.from_module: {type(m).__name__}.{name} must be an nn.Parameter, got {type(p).__name__}"
        )
    if tuple(p.shape) != (n,):
        raise ValueError(f"{cls}.from_module: {type(m).__name__}.{name} has shape {tuple(p.shape)}; expected ({n},)")
    return p


def _size_of(cls: str, m: nn.Module) -> int:
    """The normalized size of a norm module: its ``normalized_shape``, else its weight's length."""
    shape = getattr(m, "normalized_shape", None)
    if shape is None:
        weight = getattr(m, "weight", None)
        if not isinstance(weight, torch.Tensor):
            raise ValueError(f"{cls}.from_module: {type(m).__name__} has neither `normalized_shape` nor a `weight`")
        shape = tuple(weight.shape)
    return _single_dim(cls, shape)


class RMSNorm(nn.Module):
    """RMSNorm over the last dim: ``y = x * rsqrt(mean(x^2) + eps) * (offset + weight)``.

    Args:
        hidden_size: N, an int or a 1-tuple (torch's ``normalized_shape``).
        eps: added to mean(x^2). None means ``torch.finfo(x.dtype).eps``, as in torch.nn.RMSNorm.
        elementwise_affine: hold a learnable ``weight`` (N,), initialized to ones (to zeros with an
            offset, so that the scale starts at one either way).
        offset: added to the weight before it scales; 0 (Llama) or 1 (Gemma's ``x * (1 + w)``). The
            scale ``offset + weight`` is formed in fp32 inside the op, as Gemma does, so a bf16 weight
            near zero keeps its precision.

    State dict: ``weight``, as torch.nn.RMSNorm and HF LlamaRMSNorm. ``variance_epsilon`` (HF's
    name) reads and writes ``eps``. Output dtype is x's dtype (HF LlamaRMSNorm returns the promoted
    dtype of weight and x; the two agree whenever weight and x share a dtype).
    """

    def __init__(
        self,
        hidden_size: int | tuple[int, ...],
        eps: float | None = 1e-6,
        elementwise_affine: bool = True,
        *,
        offset: float = 0.0,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if isinstance(offset, bool) or not isinstance(offset, (int, float)):
            raise ValueError(f"RMSNorm: offset must be a float, got {offset!r}")
        self.offset = float(offset)
        self.hidden_size = _single_dim("RMSNorm", hidden_size)
        self.normalized_shape = (self.hidden_size,)
        _check_eps("RMSNorm", eps, allow_none=True)
        self.eps = eps
        self.elementwise_affine = bool(elementwise_affine)
        if self.elementwise_affine:
            self.weight = nn.Parameter(torch.empty(self.hidden_size, dtype=dtype, device=device))
        else:
            self.register_parameter("weight", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.weight is not None:
            nn.init.zeros_(self.weight) if self.offset else nn.init.ones_(self.weight)

    @property
    def variance_epsilon(self) -> float | None:
        """HF's name for ``eps`` (LlamaRMSNorm and its kin)."""
        return self.eps

    @variance_epsilon.setter
    def variance_epsilon(self, value: float | None) -> None:
        _check_eps("RMSNorm", value, allow_none=True)
        self.eps = value

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x (..., N) -> y (..., N); with ``residual`` (like x): (norm(x + residual), x + residual)."""
        _check_last_dim("RMSNorm", x, self.hidden_size)
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        if self.weight is not None:
            # The op forms offset + weight in fp32 (Gemma's order), in the kernel.
            return F.rms_norm(x, self.weight, eps=eps, residual=residual, offset=self.offset)
        if self.offset and self.offset != 1.0:  # no weight: the scale is the offset alone
            scale = torch.full((self.hidden_size,), self.offset, device=x.device)
            return F.rms_norm(x, scale, eps=eps, residual=residual)
        return F.rms_norm(x, None, eps=eps, residual=residual)

    def extra_repr(self) -> str:
        offset = f", offset={self.offset}" if self.offset else ""
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}{offset}"

    @classmethod
    def from_module(cls, m: nn.Module, *, offset: float = 0.0) -> RMSNorm:
        """An RMSNorm sharing ``m``'s weight (the same Parameter object) and epsilon.

        ``m``: a torch.nn.RMSNorm, an HF LlamaRMSNorm, or any module computing
        ``x * rsqrt(mean(x^2) + eps) * (offset + weight)`` with a ``weight`` (N,) (or None) and ``eps``
        or ``variance_epsilon``. Gemma's ``* (1 + weight)`` looks the same from outside: the caller
        says ``offset=1.0`` (the fusion pass knows it by the architecture, and its numeric check
        catches a wrong guess).
        """
        eps = _eps_of("RMSNorm", m)
        n = _size_of("RMSNorm", m)
        new = cls(n, eps=eps, elementwise_affine=False, offset=offset)
        weight = _shared_param("RMSNorm", m, "weight", n)
        if weight is not None:
            new.weight = weight
            new.elementwise_affine = True
        return new


class LayerNorm(nn.Module):
    """LayerNorm over the last dim, what torch.nn.LayerNorm computes:
    ``y = (x - mean(x)) * rsqrt(var(x) + eps) * weight + bias`` (biased variance).

    Args:
        normalized_shape: N, an int or a 1-tuple.
        eps: added to the variance.
        elementwise_affine: hold a learnable ``weight`` (N,) (ones) and, with ``bias``, a ``bias``
            (N,) (zeros).
        bias: hold a bias when ``elementwise_affine``.

    State dict: ``weight`` and ``bias``, as torch.nn.LayerNorm.
    """

    def __init__(
        self,
        normalized_shape: int | tuple[int, ...],
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool = True,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        n = _single_dim("LayerNorm", normalized_shape)
        self.normalized_shape = (n,)
        _check_eps("LayerNorm", eps)
        self.eps = eps
        self.elementwise_affine = bool(elementwise_affine)
        if self.elementwise_affine:
            self.weight = nn.Parameter(torch.empty(n, dtype=dtype, device=device))
        else:
            self.register_parameter("weight", None)
        if self.elementwise_affine and bias:
            self.bias = nn.Parameter(torch.empty(n, dtype=dtype, device=device))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.weight is not None:
            nn.init.ones_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x (..., N) -> y (..., N); with ``residual`` (like x): (norm(x + residual), x + residual)."""
        _check_last_dim("LayerNorm", x, self.normalized_shape[0])
        return F.layer_norm(x, self.weight, self.bias, eps=self.eps, residual=residual)

    def extra_repr(self) -> str:
        return (
            f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}, "
            f"bias={self.bias is not None}"
        )

    @classmethod
    def from_module(cls, m: nn.Module) -> LayerNorm:
        """A LayerNorm sharing ``m``'s weight and bias (the same Parameter objects) and epsilon.

        ``m``: a torch.nn.LayerNorm over one dim, or any module computing a LayerNorm with ``weight``
        and ``bias`` (N,) (either may be None) and ``eps`` or ``variance_epsilon``.
        """
        eps = _eps_of("LayerNorm", m)
        n = _size_of("LayerNorm", m)
        weight = _shared_param("LayerNorm", m, "weight", n)
        bias = _shared_param("LayerNorm", m, "bias", n)
        new = cls(n, eps=eps, elementwise_affine=False)
        if weight is not None:
            new.weight = weight
        if bias is not None:
            new.bias = bias
        new.elementwise_affine = weight is not None or bias is not None
        return new
