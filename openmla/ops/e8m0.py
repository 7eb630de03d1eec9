"""E8M0 (OCP MX) scale bytes: an exponent-only byte ``b`` meaning ``2^(b - 127)``; 255 is NaN.

``scale_to_e8m0`` turns a checkpoint's block scales into E8M0 bytes only when that is lossless (every
value an exact power of two in ``[2^-127, 2^127]``) and raises otherwise: it never rounds a scale.
A host-side loader helper (run once per weight), so plain PyTorch rather than a kernel.
"""

from __future__ import annotations

import torch

from openmla.ops._validate import describe

__all__ = ["e8m0_to_float", "scale_to_e8m0"]


def scale_to_e8m0(scale: torch.Tensor) -> torch.Tensor:
    r"""Encode ``scale`` (any shape) as E8M0 bytes, losslessly, or raise.

    Args:
        scale (torch.Tensor): ``float8_e8m0fnu`` (reinterpreted), uint8 (already E8M0 bytes; 255 refused)
            or a floating tensor of exact powers of two in ``[2^-127, 2^127]``.

    Returns:
        torch.Tensor: uint8 bytes ``log2(scale) + 127``, same shape, contiguous.

    Raises:
        TypeError: an integer dtype other than uint8.
        ValueError: a value that is not finite, not positive, not a power of two or out of range (the
            message names the first such value).
    """
    if not isinstance(scale, torch.Tensor):
        raise TypeError(f"scale must be a torch.Tensor; got {type(scale).__name__}")
    if scale.dtype == torch.float8_e8m0fnu:
        out = scale.view(torch.uint8).contiguous()  # the stored exponent byte, not a numeric conversion
    elif scale.dtype == torch.uint8:
        out = scale.contiguous()
    elif not scale.dtype.is_floating_point:
        raise TypeError(f"scale must be a floating, uint8 or float8_e8m0fnu tensor; got dtype {scale.dtype}")
    else:
        s = scale.detach()
        if s.dtype != torch.float64:  # fp64 stays: rounding it to fp32 could turn a near power of two into one
            s = s.float()
        _first_bad(s, ~torch.isfinite(s), "finite", scale)
        _first_bad(s, s <= 0, "positive", scale)
        m, e = torch.frexp(s)  # s = m * 2^e, m in [0.5, 1): a power of two iff m == 0.5
        _first_bad(s, m != 0.5, "an exact power of two", scale)
        b = e.to(torch.int32) - 1 + 127
        _first_bad(s, (b < 0) | (b > 254), "in the E8M0 range [2^-127, 2^127]", scale)
        return b.to(torch.uint8).contiguous()
    if out.numel() and bool((out == 255).any()):
        raise ValueError(f"scale holds the E8M0 NaN byte 255; got {describe(scale)}")
    return out


def _first_bad(s: torch.Tensor, bad: torch.Tensor, what: str, scale: torch.Tensor) -> None:
    if bad.numel() and bool(bad.any()):
        i = int(bad.flatten().nonzero()[0])
        raise ValueError(f"scale must be {what} to encode as E8M0 losslessly; element {i} is "
                         f"{s.flatten()[i].item()!r} ({describe(scale)})")  # fmt: skip


def e8m0_to_float(b: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes (uint8 or float8_e8m0fnu) -> fp32 ``2^(b - 127)`` (255 -> NaN)."""
    if b.dtype == torch.uint8:
        b = b.view(torch.float8_e8m0fnu)
    if b.dtype != torch.float8_e8m0fnu:
        raise TypeError(f"b must be uint8 or float8_e8m0fnu; got dtype {b.dtype}")
    return b.float()
