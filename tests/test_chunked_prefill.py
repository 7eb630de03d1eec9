"""mla_prefill_with_context: the context read from the paged cache in 1, 2 or many chunks equals the
unchunked reference; requests with no context, no new tokens, odd block sizes, fp8 caches."""

from __future__ import annotations

import math

import pytest
import torch

import openmla.ops.prefill as prefill_ops
from openmla import flash_attn_varlen, mla_prefill_with_context
from openmla.ops.chunked_prefill import _plan_context_chunks
from openmla.reference import ds_mla_row_ref, mla_prefill_with_context_ref
from openmla.utils.testing import TOLERANCES, assert_close, pick

# heads, d_nope, d_rope, d_v, d_c (latent)
H, P, R, V, L = pick(cpu=(2, 16, 16, 16, 32), gpu=(16, 128, 64, 128, 512))
# new tokens and context per request: a request with context but no new token (1), requests without
# context (2, 5), a single new token (3)
QLENS, CTX = pick(
    cpu=([3, 0, 5, 1, 2, 4], [7, 4, 0, 13, 2, 0]),
    gpu=([200, 0, 513, 1, 64, 300], [1500, 700, 0, 3000, 65, 0]),
)
BLOCK = pick(cpu=4, gpu=64)
SCALE = (P + R) ** -0.5


@pytest.fixture(autouse=True)
def _fixed_tiles(monkeypatch):
    """On a GPU, one fixed tile per head-dim class: autotuning every test shape costs minutes of compiles."""
    monkeypatch.setattr(prefill_ops, "AUTOTUNE", False)


def _total_ctx():
    return sum(c for c, q in zip(CTX, QLENS) if q > 0)


CHUNKS = {  # chunk_size per label
    "one": 10**9,
    "two": math.ceil(_total_ctx() / 2),
    "many": pick(cpu=5, gpu=257),
    "per_token": pick(cpu=1, gpu=97),
}


def _case(cache_dtype, *, exact, block_size=BLOCK, dtype=torch.bfloat16, qlens=QLENS, ctx=CTX, device="cpu", R=R):
    """Inputs of one call, with the cache positions outside every context poisoned with NaN.

    exact: latents in {-1, 0, 1} and a sparse kv_b_proj in {-1, 0, 1}/16, so the up-projection is exact
    in bf16 and the reference comparison sees only the attention's own rounding.
    """
    B, T = len(qlens), sum(qlens)
    d_c = 512 if cache_dtype == "fp8_ds_mla" else L  # (fp8_ds_mla also fixes R = 64)
    blocks = [max(1, -(-c // block_size)) for c in ctx]
    num_blocks = sum(blocks) + 3
    perm = torch.randperm(num_blocks)
    table = torch.full((B, max(blocks) + 1), -1, dtype=torch.int32)
    used = 0
    for b, n in enumerate(blocks):
        table[b, :n] = perm[used : used + n].int()
        used += n
    rows = torch.full((num_blocks * block_size, d_c + R), float("nan"))
    for b, c in enumerate(ctx):
        pos = torch.arange(c)
        slots = table[b, pos // block_size].long() * block_size + pos % block_size
        lat = torch.randint(-1, 2, (c, d_c)).float() if exact else torch.randn(c, d_c)
        rows[slots] = torch.cat([lat, torch.randn(c, R)], dim=1)
    kv_scale = None
    if cache_dtype == "auto":
        cache = rows.to(dtype).view(num_blocks, block_size, d_c + R)
    elif cache_dtype == "fp8":
        kv_scale = torch.tensor([0.5])
        cache = (rows / kv_scale).to(torch.float8_e4m3fn).view(num_blocks, block_size, d_c + R)
    else:  # fp8_ds_mla: 656-byte rows (NaN rows are encoded as they come; they are never read)
        finite = torch.nan_to_num(rows, nan=0.0)
        cache = ds_mla_row_ref(finite[:, :512], finite[:, 512:]).view(num_blocks, block_size, 656)
    if exact:
        W = torch.randint(-1, 2, (H * (P + V), d_c)).float() * (torch.rand(H * (P + V), d_c) < 0.1) / 16
    else:
        W = torch.randn(H * (P + V), d_c) / d_c**0.5
    qsl = torch.tensor([0] + torch.tensor(qlens).cumsum(0).tolist(), dtype=torch.int32)
    to = dict(device=device)
    return dict(
        q=torch.randn(T, H, P + R).to(dtype).to(**to),
        k_nope=torch.randn(T, H, P).to(dtype).to(**to),
        k_pe=torch.randn(T, R).to(dtype).to(**to),
        v=torch.randn(T, H, V).to(dtype).to(**to),
        kv_cache=cache.to(**to),
        block_table=table.to(**to),
        context_lens=torch.tensor(ctx, dtype=torch.int32, device=device),
        query_start_loc=qsl.to(**to),
        kv_b_proj_weight=W.to(dtype).to(**to),
        sm_scale=(P + R) ** -0.5,
    ), dict(kv_cache_dtype=cache_dtype, kv_scale=None if kv_scale is None else kv_scale.to(**to))


def _ref(args, kw):
    cpu = {n: (t.cpu() if isinstance(t, torch.Tensor) else t) for n, t in args.items()}
    scale = kw["kv_scale"].cpu() if kw["kv_scale"] is not None else None
    return mla_prefill_with_context_ref(**cpu, kv_cache_dtype=kw["kv_cache_dtype"], kv_scale=scale)


@pytest.mark.parametrize("chunks", list(CHUNKS), ids=[f"chunks_{c}" for c in CHUNKS])
@pytest.mark.parametrize("cache_dtype", ["auto", "fp8"])
def test_matches_reference(cache_dtype, chunks, device):
    args, kw = _case(cache_dtype, exact=True, device=device)
    out, lse = mla_prefill_with_context(**args, **kw, chunk_size=CHUNKS[chunks], return_lse=True)
    ref_out, ref_lse = _ref(args, kw)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert_close("out", ref_out, out, *TOLERANCES[torch.bfloat16])
    assert_close("lse", ref_lse, lse, *TOLERANCES[torch.bfloat16])


@pytest.mark.parametrize("block_size", [1, 3, pick(cpu=16, gpu=256)], ids=lambda b: f"BS{b}")
def test_block_sizes(block_size, device):
    args, kw = _case("auto", exact=True, block_size=block_size, device=device)
    out, lse = mla_prefill_with_context(**args, **kw, chunk_size=CHUNKS["many"], return_lse=True)
    ref_out, ref_lse = _ref(args, kw)
    assert_close("out", ref_out, out, *TOLERANCES[torch.bfloat16])
    assert_close("lse", ref_lse, lse, *TOLERANCES[torch.bfloat16])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_chunking_does_not_change_the_result(dtype, device):
    """Random (inexact) data: every chunking agrees with the single chunk (fp32 running output)."""
    args, kw = _case("auto", exact=False, dtype=dtype, device=device)
    one, one_lse = mla_prefill_with_context(**args, **kw, chunk_size=CHUNKS["one"], return_lse=True)
    for label in ("two", "many", "per_token"):
        out, lse = mla_prefill_with_context(**args, **kw, chunk_size=CHUNKS[label], return_lse=True)
        assert_close(f"out[{label}]", one.float(), out, *TOLERANCES[dtype])
        assert_close(f"lse[{label}]", one_lse, lse, *TOLERANCES[torch.float32])


def test_fp32(device):
    """fp32 activations and cache (the CPU engine's dtype): exact dots, fp32 tolerances."""
    args, kw = _case("auto", exact=False, dtype=torch.float32, device=device)
    out, lse = mla_prefill_with_context(**args, **kw, chunk_size=CHUNKS["many"], return_lse=True)
    ref_out, ref_lse = _ref(args, kw)
    assert_close("out", ref_out, out, *TOLERANCES[torch.float32])
    assert_close("lse", ref_lse, lse, *TOLERANCES[torch.float32])


def test_fp8_ds_mla_cache(device):
    args, kw = _case("fp8_ds_mla", exact=False, device=device, R=64)
    out, lse = mla_prefill_with_context(**args, **kw, chunk_size=CHUNKS["many"], return_lse=True)
    ref_out, ref_lse = _ref(args, kw)
    # inexact bf16 up-projection: a context key element may round to the neighbouring bf16 value in the
    # kernel (torch.mm) and in the reference (fp32 matmul then rounding) -> bf16 atol/rtol, with the
    # cosine bound of two bf16 roundings
    atol, rtol, cos = TOLERANCES[torch.bfloat16]
    assert_close("out", ref_out, out, atol, rtol, 4 * cos)
    assert_close("lse", ref_lse, lse, atol, rtol, 4 * cos)


def test_no_context_is_causal_attention(device):
    ctx = [0] * len(QLENS)
    args, kw = _case("auto", exact=False, ctx=ctx, device=device)
    out, lse = mla_prefill_with_context(**args, **kw, chunk_size=CHUNKS["many"], return_lse=True)
    k = torch.cat([args["k_nope"], args["k_pe"][:, None, :].expand(-1, H, R)], dim=-1)
    qsl = args["query_start_loc"]
    ref, ref_lse = flash_attn_varlen(args["q"], k, args["v"], qsl, qsl, max(QLENS), max(QLENS), SCALE)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=0)


def test_options(device):
    """k_pe [T, 1, R], an out= buffer, CPU copies of the lengths, no LSE."""
    args, kw = _case("auto", exact=True, device=device)
    ref_out, _ = _ref(args, kw)
    T = args["q"].shape[0]
    args["k_pe"] = args["k_pe"].view(T, 1, R)
    buf = torch.empty(T, H, V, dtype=torch.bfloat16, device=device)
    out, lse = mla_prefill_with_context(
        **args, **kw, chunk_size=CHUNKS["two"], out=buf, return_lse=False,
        context_lens_cpu=args["context_lens"].cpu(), query_start_loc_cpu=args["query_start_loc"].cpu(),
    )  # fmt: skip
    assert lse is None and out.data_ptr() == buf.data_ptr()
    assert_close("out", ref_out, out, *TOLERANCES[torch.bfloat16])


@pytest.mark.parametrize("chunk_size", [1, 4, 6, 1000])
def test_plan(chunk_size):
    """Chunks hold at most chunk_size tokens, cover each request's context [0, ctx) in order, once."""
    qlens, ctx = [3, 0, 5, 1, 2, 4], [7, 4, 0, 13, 2, 0]
    qsl = torch.tensor([0] + torch.tensor(qlens).cumsum(0).tolist())
    chunks = _plan_context_chunks(torch.tensor(ctx), qsl, chunk_size)
    total = sum(c for c, q in zip(ctx, qlens) if q)
    assert len(chunks) == -(-total // chunk_size)
    seen = {b: [] for b in range(len(ctx))}
    for c in chunks:
        assert 0 < c.num_tokens <= chunk_size and c.num_tokens == int(c.lens.sum())
        assert c.r0 == int(qsl[c.b0]) and c.r1 == int(qsl[c.b1])
        assert c.cu_k.tolist() == [0] + torch.cumsum(c.lens, 0).tolist()
        for i, b in enumerate(range(c.b0, c.b1)):
            s, n = int(c.starts[i]), int(c.lens[i])
            seen[b] += list(range(s, s + n))
    for b in range(len(ctx)):
        assert seen[b] == list(range(ctx[b] if qlens[b] else 0))


def test_bad_inputs(device):
    args, kw = _case("auto", exact=True, device=device)
    T = args["q"].shape[0]
    bad = [
        (dict(kv_b_proj_weight=args["kv_b_proj_weight"][:, :-1]), ValueError, "kv_b_proj_weight"),
        (dict(kv_b_proj_weight=args["kv_b_proj_weight"].half()), TypeError, "kv_b_proj_weight"),
        (dict(k_pe=args["k_pe"][:, :-1]), ValueError, "k_pe"),
        (dict(k_nope=args["k_nope"].half()), TypeError, "k_nope"),
        (dict(v=args["v"][:-1]), ValueError, "v"),
        (dict(q=args["q"].int()), TypeError, "q"),
        (dict(context_lens=args["context_lens"][:-1]), ValueError, "context_lens"),
        (dict(query_start_loc=args["query_start_loc"].float()), TypeError, "query_start_loc"),
        (dict(chunk_size=0), ValueError, "chunk_size"),
        (dict(out=torch.empty(T, H, V + 1, dtype=torch.bfloat16, device=device)), ValueError, "out"),
        (dict(context_lens_cpu=torch.zeros(2)), ValueError, "context_lens_cpu"),
    ]
    for change, exc, word in bad:
        call = {**args, **kw, "chunk_size": 4, **change}
        with pytest.raises(exc, match=word):
            mla_prefill_with_context(**call)
