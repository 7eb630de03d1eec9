"""Input checks shared by the launchers: clear errors that name the argument, its shape and dtype."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import torch

from openmla.device import check_kernel_device

INDEX_DTYPES = (torch.int32, torch.int64)
FLOAT16_DTYPES = (torch.bfloat16, torch.float16)


def describe(t: torch.Tensor) -> str:
    return f"shape {tuple(t.shape)}, dtype {t.dtype}, device {t.device}"


def check_tensor(
    name: str,
    t,
    *,
    dtypes: Sequence[torch.dtype] | None = None,
    ndim: int | None = None,
    shape: Sequence[int | None] | None = None,
    device: torch.device | None = None,
    last_dim_contiguous: bool = True,
    kernel: bool = True,
) -> torch.Tensor:
    """Check one tensor argument; ``shape`` entries of None match anything. ``kernel=False``: a torch-only
    helper's argument, on any device (no check that a Triton kernel can run there)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        names = ", ".join(str(d) for d in dtypes)
        raise TypeError(f"{name} must have dtype in ({names}); got {describe(t)}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D; got {describe(t)}")
    if shape is not None:
        if t.dim() != len(shape) or any(s is not None and s != d for s, d in zip(shape, t.shape)):
            want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            raise ValueError(f"{name} must have shape {want}; got {describe(t)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} must be on {device} like the other inputs; got {describe(t)}")
    if last_dim_contiguous and t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension; got strides {t.stride()}")
    if kernel:
        check_kernel_device(name, t)
    return t


def check_index(
    name: str, t, *, ndim: int, device: torch.device | None = None, length: int | None = None, kernel: bool = True
):
    """Integer index tensors (int32/int64); a floating dtype is a TypeError (``kernel`` as in check_tensor)."""
    if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.dtype == torch.bool):
        raise TypeError(f"{name} must be an int32 or int64 index tensor; got {describe(t)}")
    check_tensor(name, t, dtypes=INDEX_DTYPES, ndim=ndim, device=device, last_dim_contiguous=False, kernel=kernel)
    if length is not None and t.shape[0] != length:
        raise ValueError(f"{name} must have {length} entries along dim 0; got {describe(t)}")
    return t


def check_no_overlap(name: str, t: torch.Tensor) -> None:
    """Refuse a tensor written in place whose elements share memory (an expanded or overlapping view): the
    kernels write each element from its own program, so such a view would end up with an arbitrary winner."""
    if t.numel() == 0:
        return
    span = 1  # 1 + the largest offset reached by the dims taken so far, smallest stride first
    for stride, size in sorted((t.stride(i), t.shape[i]) for i in range(t.dim()) if t.shape[i] > 1):
        if stride < span:
            raise ValueError(f"{name} must not overlap itself (an expanded view?); got {describe(t)}, "
                             f"strides {t.stride()}")  # fmt: skip
        span += stride * (size - 1)


def kernel_backend(backend: str | None, env: str) -> str:
    """A kernel tier: ``backend``, else the environment variable ``env``, else "auto"; checked to be
    "auto", "triton" or "gluon"."""
    backend = backend or os.environ.get(env, "auto")
    if backend not in ("auto", "triton", "gluon"):
        raise ValueError(f'backend must be "auto", "triton" or "gluon"; got {backend!r}')
    return backend


def capturing() -> bool:
    """True while a CUDA graph is being captured (no host synchronisation allowed then)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def check_positive_ints(*named: tuple[str, object]) -> None:
    """Raise ValueError naming the first ``(name, value)`` whose value is not a positive int (a bool is not one)."""
    for name, val in named:
        if not isinstance(val, int) or isinstance(val, bool) or val < 1:
            raise ValueError(f"{name} must be a positive int; got {val!r}")


def check_scale_value(name: str, value: float) -> float:
    """A per-tensor scale must be positive and finite (0 would divide by zero, a negative one flip signs)."""
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive finite float; got {value!r}")
    return value


def scalar_scale(name: str, scale, device: torch.device, *, validate: bool = True) -> torch.Tensor:
    """A per-tensor fp32 scale as a 1-element device tensor (accepts a float or a 1-element tensor).

    A float is checked to be positive and finite; a tensor's value only when ``validate`` (a host sync;
    never while a CUDA graph is captured)."""
    if scale is None:
        raise ValueError(f"{name} is required for an fp8 cache (stored = value / {name})")
    if isinstance(scale, bool):
        raise TypeError(f"{name} must be a float or a 1-element tensor; got {scale!r}")
    if isinstance(scale, (int, float)):
        check_scale_value(name, float(scale))
        return torch.full((1,), float(scale), dtype=torch.float32, device=device)
    if not isinstance(scale, torch.Tensor) or scale.numel() != 1:
        raise ValueError(f"{name} must be a float or a 1-element tensor; got {scale!r}")
    if not scale.is_floating_point():
        raise TypeError(f"{name} must be a floating tensor; got dtype {scale.dtype}")
    scale = scale.reshape(1).to(device=device, dtype=torch.float32)
    if validate and not capturing():
        check_scale_value(name, float(scale))
    return scale
