"""Test helpers: device/shape selection and the one comparison routine every test uses."""

from __future__ import annotations

import os
from typing import TypeVar

import torch

from openmla.device import INTERPRET

T = TypeVar("T")

__all__ = ["suite_device", "on_gpu", "pick", "assert_close", "TOLERANCES"]


def suite_device() -> torch.device:
    """The device the test suite runs on: ``OPENMLA_TEST_DEVICE`` or cuda when available."""
    name = os.environ.get("OPENMLA_TEST_DEVICE")
    if name is None:
        name = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
    return torch.device(name)


def on_gpu() -> bool:
    return suite_device().type == "cuda"


def pick(cpu: T, gpu: T) -> T:
    """Tiny shapes under the CPU interpreter, real shapes on a GPU."""
    return gpu if on_gpu() else cpu


# atol, rtol, cosine-difference bound per dtype of the kernel's inputs (vs an fp32 reference).
TOLERANCES = {
    torch.float32: (1e-4, 1e-4, 1e-6),
    torch.float16: (2e-3, 2e-3, 1e-5),
    torch.bfloat16: (1.6e-2, 1.6e-2, 1e-5),
    # fp8 e4m3 has 3 mantissa bits: per-element error up to ~6% of the value; the cosine bound is
    # the AITER test's 3e-2.
    torch.float8_e4m3fn: (1e-1, 1e-1, 3e-2),
}


def _cos_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    a = a.double().flatten()
    b = b.double().flatten()
    denom = (a * a + b * b).sum()
    if denom == 0:
        return 0.0
    return float(1 - 2 * (a * b).sum() / denom)


def assert_close(name: str, ref: torch.Tensor, out: torch.Tensor, atol: float, rtol: float, cos_tol: float) -> None:
    """Compare ``out`` with ``ref`` (FlashMLA's ``check_is_allclose``).

    First the non-finite values must sit at the same places with the same values (NaN where NaN,
    +inf where +inf, -inf where -inf); then the finite values must satisfy
    ``|out - ref| <= atol + rtol * |ref|``; then the cosine difference ``1 - 2<a,b>/(|a|^2+|b|^2)`` of
    the finite values must be at most ``cos_tol``.
    """
    if ref.shape != out.shape:
        raise AssertionError(f"{name}: shape {tuple(out.shape)} != reference {tuple(ref.shape)}")
    ref = ref.detach().float().cpu()
    out = out.detach().float().cpu()
    for label, fn in (("nan", torch.isnan), ("+inf", torch.isposinf), ("-inf", torch.isneginf)):
        r, o = fn(ref), fn(out)
        if not torch.equal(r, o):
            bad = (r != o).nonzero()[:5].tolist()
            raise AssertionError(f"{name}: {label} positions differ, e.g. at {bad}")
    finite = torch.isfinite(ref)
    r, o = ref[finite], out[finite]
    if r.numel() == 0:
        return
    err = (o - r).abs()
    bound = atol + rtol * r.abs()
    if not bool((err <= bound).all()):
        i = int(torch.argmax(err - bound))
        raise AssertionError(
            f"{name}: max abs err {err.max().item():.3e} (at flat {i}: out {o[i].item():.6g} ref {r[i].item():.6g}), "
            f"atol {atol} rtol {rtol}, {(err > bound).sum().item()} of {r.numel()} elements out of bounds"
        )
    cd = _cos_diff(r, o)
    if cd > cos_tol:
        raise AssertionError(f"{name}: cosine difference {cd:.3e} > {cos_tol}")


def random_v4_cache(num_blocks: int, block_size: int, kv_cache_dtype: str, used, device, gen: torch.Generator):
    """A V4 cache (tests) whose slots ``used`` hold random rows (~N(0, 1), two groups scaled by 1e-3 and 4 to spread
    the UE8M0 exponents); every other slot is NaN (bf16 "auto") or 0xFF bytes (fp8_v4: NaN e4m3, exponent 255, NaN
    rope), which a kernel must never read."""
    from openmla.ops.cache_v4 import allocate_v4_cache
    from openmla.reference.v4 import v4_block_bytes, v4_encode_blocks_ref

    rows = torch.randn(len(used), 512, generator=gen)
    rows[:, 64:128] *= 1e-3
    rows[:, 256:320] *= 4.0
    if kv_cache_dtype == "auto":
        cache = torch.full((num_blocks * block_size, 512), float("nan"), dtype=torch.bfloat16)
        cache[used] = rows.bfloat16()
        return cache.view(num_blocks, block_size, 512).to(device)
    host = allocate_v4_cache(num_blocks, block_size, fill=0xFF, device="cpu")
    v4_encode_blocks_ref(v4_block_bytes(host), block_size, used, rows)
    cache = allocate_v4_cache(num_blocks, block_size, fill=0xFF, device=device)
    v4_block_bytes(cache).copy_(v4_block_bytes(host))
    return cache
