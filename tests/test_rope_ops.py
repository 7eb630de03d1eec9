"""inverse_rope_rows against a torch rotation, and the jit helpers through it."""

import math

import pytest
import torch
import triton
import triton.language as tl

import openmla  # noqa: F401
from openmla.ops.rope import inverse_rope_rows, load_cos_sin, rope_pairs, rope_rows_
from openmla.reference.v4 import inverse_rope_rows_ref, rope_cache_ref, rope_rows_ref
from openmla.utils.testing import assert_close, pick


def _table(num_pos, device, theta=10000.0):
    inv_freq = 1.0 / theta ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64)
    return rope_cache_ref(inv_freq, num_pos).to(device)


def _torch_rotation(o, positions, theta=10000.0):
    """Independent oracle: complex multiplication of (a + ib) by exp(-i pos f)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64)
    ang = (positions.float().cpu()[:, None] * inv_freq[None, :]).double()  # [T, 32], the table's fp32 angles
    z = torch.view_as_complex(o.double().cpu()[..., 448:].reshape(*o.shape[:-1], 32, 2).contiguous())
    rot = torch.polar(torch.ones_like(ang), -ang).reshape(o.shape[0], *([1] * (o.dim() - 2)), 32)
    out = o.double().cpu().clone()
    out[..., 448:] = torch.view_as_real(z * rot).reshape(*o.shape[:-1], 64)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("heads", [None, 3, 16])
def test_inverse_rope_rows(dtype, heads, device):
    T, P = pick(5, 300), pick(64, 65536)
    shape = (T, 512) if heads is None else (T, heads, 512)
    o = torch.randn(shape, device=device).to(dtype)
    pos = torch.randint(0, P, (T,), device=device)
    pos[0] = 0
    table = _table(P, device)
    want = _torch_rotation(o, pos)
    ref = inverse_rope_rows_ref(o, pos, table)
    assert_close("ref vs complex rotation", want, ref, 1e-5, 1e-5, 1e-9)
    got = inverse_rope_rows(o, pos, table)
    assert got.data_ptr() == o.data_ptr()
    if dtype == torch.float32:
        assert_close("inverse rope", ref, o, 1e-5, 1e-5, 1e-9)
    else:  # one bf16 rounding of the rotated fp32 value (atol: a near-cancelling pair's fp32 rounding, FMA or
        # not, on the GPU); the nope lanes pass through bit for bit
        assert_close("inverse rope", ref, o, 1e-6, 2**-8, 1e-5)
        assert torch.equal(o[..., :448].cpu(), ref[..., :448].to(dtype).cpu())
    # forward then inverse is the identity
    x = torch.randn(T, 512, device=device)
    fwd = rope_rows_ref(x, pos, table)
    back = inverse_rope_rows(fwd.clone(), pos, table)
    assert_close("round trip", x, back, 1e-5, 1e-5, 1e-9)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda d: str(d).replace("torch.", ""))
def test_forward_rope_rows(dtype, device):
    # the forward twin (V4's indexer q heads [T, H, 128], rope on the last 64): the fp32 reference's rotation, one
    # rounding; the nope lanes untouched; inverse after forward gives the rows back; a position outside the table
    # is refused, or under validate=False left unrotated
    T, H, P = pick(5, 300), 3, 64
    x = torch.randn(T, H, 128, device=device).to(dtype)
    pos = torch.randint(0, P, (T,), device=device)
    table = _table(P, device)
    ref = rope_rows_ref(x, pos, table)
    got = rope_rows_(x.clone(), pos, table)
    tol = (1e-5, 1e-5) if dtype == torch.float32 else (1e-6, 2**-8)
    assert_close("forward rope", ref, got, *tol, 1e-5)
    assert torch.equal(got[..., :64], x[..., :64])
    assert_close("round trip", x.float(), inverse_rope_rows(got.float().clone(), pos, table), 1e-2, 1e-2, 1e-4)
    bad = pos.clone()
    bad[0] = P
    with pytest.raises(ValueError, match="positions span"):
        rope_rows_(x.clone(), bad, table)
    y = rope_rows_(x.clone(), bad, table, validate=False)
    assert torch.equal(y[0], x[0]) and torch.equal(y[1:], got[1:])
    with pytest.raises(TypeError, match="x must have dtype"):
        rope_rows_(x.int(), pos, table)


def test_inverse_rope_rows_strided(device):
    T = pick(4, 64)
    base = torch.randn(T, 6, 512, device=device)
    o = base[:, ::2]  # non-contiguous heads
    pos = torch.arange(T, device=device) * 3
    table = _table(4 * T, device)
    ref = inverse_rope_rows_ref(o, pos, table)
    untouched = base[:, 1::2].clone()
    inverse_rope_rows(o, pos, table)
    assert_close("strided", ref, o, 1e-5, 1e-5, 1e-9)
    assert torch.equal(base[:, 1::2], untouched)


def test_inverse_rope_rows_edges(device):
    table = _table(8, device)
    o = torch.randn(0, 4, 512, device=device)
    assert inverse_rope_rows(o, torch.zeros(0, dtype=torch.int32, device=device), table) is o
    x = torch.randn(2, 512, device=device)
    with pytest.raises(ValueError, match="positions span"):
        inverse_rope_rows(x, torch.tensor([0, 8], device=device), table)
    before = x.clone()
    inverse_rope_rows(x, torch.tensor([-1, 8], device=device), table, validate=False)  # unknown rows unchanged
    assert torch.equal(x, before)
    with pytest.raises(TypeError, match="positions"):
        inverse_rope_rows(x, torch.tensor([0.0, 1.0], device=device), table)
    with pytest.raises(ValueError, match="cos_sin_cache"):
        inverse_rope_rows(x, torch.tensor([0, 1], device=device), table[:, :48])
    with pytest.raises(TypeError, match="o must"):
        inverse_rope_rows(x.int(), torch.tensor([0, 1], device=device), table)
    assert math.isfinite(float(x.sum()))


def test_inverse_rope_matches_transformers(device):
    """V4's output un-rotation in transformers: apply_rotary_pos_emb(o, cos, -sin) on the last 64 dims."""
    pytest.importorskip("transformers")
    try:
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import apply_rotary_pos_emb
    except ImportError:
        pytest.skip("transformers has no deepseek_v4")
    T, H, P = pick(6, 200), pick(2, 16), 4096
    inv_freq = 1.0 / 160000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64)
    pos = torch.randint(0, P, (T,))
    freqs = pos[:, None].float() * inv_freq[None, :]
    o = torch.randn(T, H, 512)
    want = apply_rotary_pos_emb(o.transpose(0, 1)[None], freqs.cos()[None], -freqs.sin()[None])[0].transpose(0, 1)
    got = inverse_rope_rows(o.to(device), pos.to(device), rope_cache_ref(inv_freq, P).to(device))
    assert_close("vs transformers", want, got, 1e-5, 1e-5, 1e-9)


def test_strided_positions(device):
    table = _table(32, device)
    o = torch.randn(4, 2, 512, device=device)
    pos = torch.tensor([[3, 0], [31, 0], [0, 0], [7, 0]], device=device)[:, 0]
    ref = inverse_rope_rows_ref(o, pos, table)
    assert_close("strided positions", ref, inverse_rope_rows(o, pos, table), 1e-5, 1e-5, 1e-9)


@triton.jit
def _chunk_kernel(x, table, pos, stride_cs, num_pos, M: tl.constexpr):
    # a sparse kernel's epilogue: un-rotate the rope half of the last 128-lane accumulator chunk in place
    o_m = tl.arange(0, M)
    o_n = tl.arange(0, 128)
    b_x = tl.load(x + o_m[:, None] * 128 + o_n[None, :])
    b_cos, b_sin = load_cos_sin(table, tl.load(pos + o_m), stride_cs, num_pos, 32, 128, 64)
    tl.store(x + o_m[:, None] * 128 + o_n[None, :], rope_pairs(b_x, b_cos, b_sin, M, 128, True))


def test_jit_helpers_on_an_accumulator_chunk(device):
    """The epilogue use in a sparse kernel: a [BLOCK_H, 128] chunk whose last 64 lanes (dims 448..511) are the
    rope pairs: load_cos_sin(..., N=128, N0=64) leaves the first 64 lanes alone."""
    M = 8
    table = _table(50, device)
    pos = torch.randint(0, 50, (M,), device=device)
    pos[-1] = 77  # outside the table: unchanged
    rows = torch.randn(M, 512, device=device)
    want = inverse_rope_rows_ref(rows, pos.clamp_max(49), table)
    want[-1] = rows[-1]
    chunk = rows[:, 384:].contiguous()
    _chunk_kernel[(1,)](chunk, table, pos, table.stride(0), 50, M=M)
    assert_close("chunk", want[:, 384:], chunk, 1e-5, 1e-5, 1e-9)
