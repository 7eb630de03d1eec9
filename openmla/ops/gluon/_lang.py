"""The Gluon names the Hopper kernels use, imported once; ``GLUON_AVAILABLE`` says whether they exist.

Gluon (``triton.experimental.gluon``) ships inside triton >= 3.5. Without it every name below is None
and ``GLUON_AVAILABLE`` is False, so ``import openmla`` keeps working (the kernels are defined only
when it is True).
"""

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    GLUON_AVAILABLE = True
except (ImportError, AttributeError):  # pragma: no cover - depends on the installed triton
    gluon = gl = async_copy = fence_async_shared = mbarrier = tma = None
    warpgroup_mma = warpgroup_mma_wait = TensorDescriptor = None
    GLUON_AVAILABLE = False

__all__ = ["GLUON_AVAILABLE", "TensorDescriptor", "async_copy", "fence_async_shared", "gl", "gluon", "mbarrier", "tma",
           "warpgroup_mma", "warpgroup_mma_wait"]  # fmt: skip
