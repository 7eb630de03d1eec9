"""RMSNorm as DeepSeek V3 (and its HF model) computes it: in fp32, scaled after casting back."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["RMSNorm"]


class RMSNorm(nn.Module):
    r"""``weight * (x / sqrt(mean(x^2) + eps))``, the normalisation in fp32 and the product in x's dtype.

    Args:
        hidden_size (int): normalised (last) dimension.
        eps (float): added to the mean square.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise ``x`` `[..., hidden_size]`; returns the same shape, in the dtype of the product."""
        dtype = x.dtype
        xf = x.to(torch.float32)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)
