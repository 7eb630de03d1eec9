"""Device choice for openmla, in one place.

openmla runs its Triton kernels on a CUDA GPU when one is available and otherwise on the CPU through
the Triton interpreter. The interpreter is switched on by the environment variable
``TRITON_INTERPRET=1``, which Triton reads when a kernel is *decorated*; this module sets it (when
the user has not set it and no CUDA device exists) before any openmla kernel module is imported.
``import openmla`` imports this module first, so library users need do nothing.

Environment variables:
    ``TRITON_INTERPRET``: honoured when set by the user ("1" forces the interpreter even on a GPU
        machine, for debugging; "0" forbids it).
    ``OPENMLA_TEST_DEVICE``: ``cpu`` or ``cuda``; the device the test suite runs on (default: cuda
        when available, else cpu).
"""

from __future__ import annotations

import os

import torch

__all__ = ["INTERPRET", "default_device", "compute_dtype", "check_kernel_device"]


def _configure_interpreter() -> bool:
    value = os.environ.get("TRITON_INTERPRET")
    if value is None:
        if torch.cuda.is_available():
            return False
        os.environ["TRITON_INTERPRET"] = "1"
        return True
    return value.strip().lower() in ("1", "true", "yes", "on")


#: True when Triton kernels run through the interpreter (on CPU tensors).
INTERPRET: bool = _configure_interpreter()


def default_device() -> torch.device:
    """The device openmla computes on by default: ``cuda`` when available, else ``cpu``."""
    return torch.device("cuda" if torch.cuda.is_available() and not INTERPRET else "cpu")


def compute_dtype(dtype: torch.dtype):
    """The Triton dtype kernels convert 16-bit operands to before arithmetic.

    Under the interpreter bf16 values are stored as raw uint16, so ``tl.dot`` and arithmetic on them
    compute on bit patterns (triton#11584); kernels therefore widen bf16 (and fp8) operands to fp32
    there. On the GPU the operand dtype itself is used, so tensor cores run at bf16/fp16 rate.
    """
    import triton.language as tl

    table = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
    if dtype not in table:
        raise TypeError(f"no compute dtype for {dtype}")
    if INTERPRET and dtype == torch.bfloat16:
        return tl.float32
    return table[dtype]


def check_kernel_device(name: str, t: torch.Tensor) -> None:
    """Raise a clear error when ``t`` lives where the Triton kernels cannot run."""
    if t.device.type == "cuda":
        if INTERPRET:
            raise ValueError(f"{name} is on {t.device} but TRITON_INTERPRET=1 runs kernels on the CPU")
        return
    if t.device.type == "cpu":
        if not INTERPRET:
            raise ValueError(
                f"{name} is on the CPU; openmla kernels run on CPU tensors only under the Triton "
                "interpreter (set TRITON_INTERPRET=1 before importing triton)"
            )
        return
    raise ValueError(f"{name} is on unsupported device {t.device}")
