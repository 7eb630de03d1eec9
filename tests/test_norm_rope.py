"""rms_norm_rope against V4's torch formulation (transformers' roundings) and the fp32 reference."""

import pytest
import torch

import openmla
from openmla.ops.norm_rope import MAX_D
from openmla.reference.v4 import rms_norm_rope_ref, rope_cache_ref
from openmla.utils.testing import assert_close

EPS = 1e-6
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
_ids = lambda d: str(d).replace("torch.", "")  # noqa: E731


def _table(num_pos, device, R=64):
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, R, 2, dtype=torch.float32) / R)
    return rope_cache_ref(inv_freq, num_pos).to(device)


def _torch_v4(x, eps, weight=None, positions=None, table=None):
    """V4's q / kv preparation as transformers writes it: the weighted norm in fp32 cast once, or the unweighted
    norm with its factor in x's dtype; then GPT-J RoPE on the last R dims of the rounded row, in fp32."""
    if weight is None:
        y = x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)
    else:
        xf = x.float()
        y = (weight.float() * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps))).to(x.dtype)
    if positions is None:
        return y
    R = table.shape[1]
    cs = table[positions]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (R // 2,)
    cos, sin = cs[:, : R // 2].reshape(shape), cs[:, R // 2 :].reshape(shape)
    rope = y[..., -R:].float()
    a, b = rope[..., 0::2], rope[..., 1::2]
    rot = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
    return torch.cat([y[..., :-R], rot.to(x.dtype)], dim=-1)


def _same(name, ref, out):
    """The same roundings as torch's: each value within one unit in the last place of the dtype (the fp32
    reduction order and rsqrt differ: in fp32 a row's factor can differ in its last bits), and in bf16 / fp16 at
    most 1% of the values not bit-identical."""
    ulp = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10, torch.float32: 2.0**-21}[out.dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=1e-6, rtol=ulp, msg=name)
    if out.dtype != torch.float32:
        assert (out != ref).float().mean().item() <= 0.01, f"{name}: {(out != ref).sum().item()} values differ"


@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
@pytest.mark.parametrize("heads", [None, 3])
def test_q_and_kv_rows(dtype, heads, device):
    # q heads [T, H, 512] unweighted and the kv row [T, 512] weighted, each then RoPE'd: V4's torch formulation,
    # and the fp32 reference within the dtype's tolerance
    T = 7
    shape = (T, 512) if heads is None else (T, heads, 512)
    x = (torch.randn(shape, device=device) * 3).to(dtype)
    w = torch.rand(512, device=device) + 0.5 if heads is None else None
    table = _table(50, device)
    pos = torch.randint(0, 50, (T,), device=device)
    out = openmla.rms_norm_rope(x, EPS, weight=w, positions=pos, cos_sin_cache=table)
    assert out.shape == x.shape and out.dtype == dtype
    _same("rows", _torch_v4(x, EPS, w, pos, table), out)
    ref = rms_norm_rope_ref(x, EPS, weight=w, positions=pos, cos_sin_cache=table)
    assert_close("vs fp32", ref, out.float(), 3e-2 if dtype != torch.float32 else 1e-5, 2e-2, 1e-4)


@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
@pytest.mark.parametrize("D", [1, 6, 384, 1024, 4104])
def test_norm_only_widths(D, dtype, device):
    # any width (powers of two or not, up to hidden sizes), weighted and not, no RoPE
    x = (torch.randn(3, D, device=device) * 2).to(dtype)
    w = torch.randn(D, device=device)
    _same("weighted", _torch_v4(x, EPS, w), openmla.rms_norm_rope(x, EPS, weight=w))
    _same("unweighted", _torch_v4(x, EPS), openmla.rms_norm_rope(x, EPS))


def test_in_place_strided_and_empty(device):
    # out = x (in place) equals a fresh output; strided heads / rows in and out; the rope only on the last R dims
    # (R 32 here, D 96: the pairs start at an even column that is not a power of two); T = 0
    T, H, D = 5, 4, 96
    table = _table(20, device, R=32)
    pos = torch.randint(0, 20, (T,), device=device)
    base = torch.randn(T, 2 * H, D + 8, device=device).bfloat16()
    x = base[:, ::2, :D]  # strided heads and tokens
    fresh = openmla.rms_norm_rope(x, EPS, positions=pos, cos_sin_cache=table)
    _same("strided", _torch_v4(x, EPS, None, pos, table), fresh)
    y = x.clone()
    assert openmla.rms_norm_rope(y, EPS, positions=pos, cos_sin_cache=table, out=y) is y
    torch.testing.assert_close(y, fresh, atol=0, rtol=0)
    out = torch.zeros(T, H, 2 * D, device=device).bfloat16()[..., ::1][:, :, :D]
    openmla.rms_norm_rope(x, EPS, positions=pos, cos_sin_cache=table, out=out)
    torch.testing.assert_close(out, fresh, atol=0, rtol=0)
    e = torch.empty(0, H, D, device=device).bfloat16()
    assert openmla.rms_norm_rope(e, EPS, positions=pos[:0], cos_sin_cache=table).shape == e.shape


def test_positions_outside_the_table(device):
    # checked (a ValueError naming the span) by default; unchecked, the row is normed and left unrotated
    x = torch.randn(3, 2, 64, device=device).bfloat16()
    table = _table(8, device)
    pos = torch.tensor([1, 8, -1], device=device)
    with pytest.raises(ValueError, match=r"positions span \[-1, 8\]"):
        openmla.rms_norm_rope(x, EPS, positions=pos, cos_sin_cache=table)
    out = openmla.rms_norm_rope(x, EPS, positions=pos, cos_sin_cache=table, validate=False)
    _same("unrotated", _torch_v4(x[1:], EPS), out[1:])
    _same("rotated", _torch_v4(x[:1], EPS, None, pos[:1], table), out[:1])


def test_large_and_tiny_rows(device):
    # a row of large values and an all-zero row (r = 1 / sqrt(eps), finite): as torch, no NaN
    x = torch.zeros(2, 512, device=device)
    x[0] = 3e4 * torch.randn(512, device=device)
    x = x.bfloat16()
    out = openmla.rms_norm_rope(x, EPS, positions=torch.tensor([3, 0], device=device), cos_sin_cache=_table(4, device))
    assert not out.isnan().any() and (out[1] == 0).all()
    _same("large", _torch_v4(x, EPS, None, torch.tensor([3, 0], device=device), _table(4, device)), out)


def test_refusals(device):
    x = torch.randn(2, 3, 64, device=device).bfloat16()
    table = _table(8, device)
    pos = torch.zeros(2, dtype=torch.int32, device=device)
    bad = [
        (TypeError, "x must have dtype", (x.int(), EPS), {}),
        (ValueError, r"x must be \[T, D\] or \[T, H, D\]", (x[0, 0], EPS), {}),
        (ValueError, r"x must be \[T, D\] or \[T, H, D\]", (x[None], EPS), {}),
        (ValueError, "contiguous in its last dimension", (x[..., ::2], EPS), {}),
        (ValueError, "row width", (torch.empty(1, MAX_D + 1, device=device).bfloat16(), EPS), {}),
        (ValueError, "eps", (x, float("nan")), {}),
        (ValueError, "eps", (x, -1.0), {}),
        (ValueError, "eps", (x, True), {}),
        (ValueError, "weight must have shape", (x, EPS), dict(weight=torch.ones(32, device=device))),
        (TypeError, "weight must have dtype", (x, EPS), dict(weight=torch.ones(64, device=device).int())),
        (ValueError, "come together", (x, EPS), dict(positions=pos)),
        (ValueError, "come together", (x, EPS), dict(cos_sin_cache=table)),
        (ValueError, "positions must", (x, EPS), dict(positions=pos[:1], cos_sin_cache=table)),
        (ValueError, "power of two", (x, EPS), dict(positions=pos, cos_sin_cache=table[:, :48])),
        (ValueError, "power of two", (x[..., :32], EPS), dict(positions=pos, cos_sin_cache=table)),
        (ValueError, "D - R even", (torch.randn(2, 65, device=device), EPS),
         dict(positions=pos, cos_sin_cache=table)),
        (TypeError, "out must have dtype", (x, EPS), dict(out=x.float())),
        (ValueError, "out must have shape", (x, EPS), dict(out=x[:1])),
    ]  # fmt: skip
    for exc, match, args, kw in bad:
        with pytest.raises(exc, match=match):
            openmla.rms_norm_rope(*args, **kw)


def test_v4_norm_module_beyond_the_kernel(device):
    # V4RMSNorm takes rows wider than the kernel holds in torch, the rest through the kernel (any leading dims)
    from openmla.layers.v4 import V4RMSNorm

    for D, lead in ((MAX_D + 2, (2,)), (256, (2, 3))):
        norm = V4RMSNorm(D, EPS).to(device)
        norm.weight.data.uniform_(0.5, 1.5)
        x = torch.randn(*lead, D, device=device).bfloat16()
        _same(f"D {D}", _torch_v4(x, EPS, norm.weight), norm(x))


_SM90_SCRIPT = r"""
import json, os, sys
os.environ["TRITON_INTERPRET"] = "0"
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import openmla.ops.norm_rope as N
from openmla.utils.sm90_report import resource_report

report = []
for dt, D, weighted, rope in json.loads(sys.argv[1]):
    block_d = triton.next_power_of_2(D)
    const = dict(H=64 if rope and not weighted else 1, D=D, R=64, BLOCK_M=max(1, min(16, N.TILE_VALUES // block_d)),
                 BLOCK_D=block_d, WEIGHTED=weighted, ROPE=rope, EXACT_ROUND=False)
    ptrs = dict(x=f"*{dt}", out=f"*{dt}", weight="*fp32", positions="*i64", cos_sin_cache="*fp32")
    kern = N._rms_norm_rope_fwd_kernel
    sig = {n: "constexpr" if n in const else ptrs.get(n, "fp32" if n == "eps" else "i32") for n in kern.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kern.arg_names) if sig[n].startswith("*")}
    c = triton.compile(ASTSource(kern, sig, constexprs=const, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=8 if block_d >= 8192 else 4))
    report.append(dict(variant=[dt, D, weighted, rope], **resource_report(c)))
print("REPORT" + json.dumps(report))
"""


def test_compiles_for_sm90():
    """Offline sm90 compile (no GPU) of the layer's variants (q heads, the kv row, a LoRA-rank norm, a hidden-size
    norm, fp32 rows): no spill."""
    if torch.cuda.is_available():
        pytest.skip("the GPU runs compile the kernel for real")
    pytest.importorskip("triton.backends.nvidia")
    from openmla.utils.sm90_report import run_report_script

    variants = [["bf16", 512, False, True], ["bf16", 512, True, True], ["bf16", 1024, True, False],
                ["bf16", 7168, True, False], ["fp32", 4096, True, False], ["fp16", 96, False, True]]  # fmt: skip
    for r in run_report_script(_SM90_SCRIPT, variants):
        assert r["stack"] == 0 and r["local"] == 0 and r["regs"] <= 255, r
