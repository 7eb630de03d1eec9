"""MLAAttention with a paged cache vs the Hugging Face DeepseekV3Attention on the full sequences.

The layer is driven step by step like an engine would (prefill, chunked prefill with cached context,
decode, speculative verify) over a ragged batch whose blocks are scattered in the cache; every row it
produces must equal HF's causal attention output at that position.
"""

from __future__ import annotations

import pytest
import torch

from openmla.engine.loader import TINY_YARN
from openmla.layers import MLAAttention, RotaryEmbedding, mla_softmax_scale
from openmla.metadata import BatchSpec, MLAMetadataBuilder
from openmla.utils.testing import assert_close, pick

hf_v3 = pytest.importorskip("transformers.models.deepseek_v3.modeling_deepseek_v3")

YARN = TINY_YARN


def hf_config(heads=4, q_lora_rank=32, rope=YARN, interleave=True, hidden=64):
    from transformers import DeepseekV3Config

    cfg = DeepseekV3Config(
        vocab_size=32, hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=heads, kv_lora_rank=512,
        q_lora_rank=q_lora_rank, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32, max_position_embeddings=256,
        rope_parameters=dict(rope), rope_interleave=interleave, num_hidden_layers=1,
    )  # fmt: skip
    cfg._attn_implementation = "eager"
    return cfg


def make_pair(cfg, kv_cache_dtype="auto", dtype=torch.float32, device="cpu"):
    """The HF attention (fp32, random weights) and our layer with the same weights."""
    hf = hf_v3.DeepseekV3Attention(cfg, layer_idx=0).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5 if p.dim() == 2 else 1 + 0.1 * torch.randn_like(p))
    ours = MLAAttention(
        hidden_size=cfg.hidden_size, num_heads=cfg.num_attention_heads, q_lora_rank=cfg.q_lora_rank,
        kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim, qk_rope_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim, max_position_embeddings=cfg.max_position_embeddings,
        rope_parameters=cfg.rope_parameters, rope_interleave=cfg.rope_interleave, kv_cache_dtype=kv_cache_dtype,
    )  # fmt: skip
    missing, unexpected = ours.load_state_dict(hf.state_dict(), strict=False)
    assert not unexpected and not missing
    return hf, ours.to(device=device, dtype=dtype).eval()


@torch.no_grad()
def hf_outputs(hf, cfg, x):
    """HF attention of one full sequence ``x`` `[S, hidden]` (causal) -> `[S, hidden]`."""
    S = x.shape[0]
    rotary = hf_v3.DeepseekV3RotaryEmbedding(cfg)
    pos = torch.arange(S)[None]
    cos_sin = rotary(x[None], pos)
    mask = torch.full((S, S), float("-inf")).triu(1)[None, None]
    return hf(x[None], position_embeddings=cos_sin, attention_mask=mask)[0][0]


def run_steps(ours, xs, schedule, block_size, device, *, threshold, workspace_tokens=None, dtype=torch.float32):
    """Drive the layer through ``schedule`` (per step: tokens per request, 0 = not scheduled).

    Request blocks are taken from a shuffled free list so that tables are scattered. Returns each
    request's output rows, `[S_b, hidden]` (fp32, CPU).
    """
    B = len(xs)
    max_len = max(x.shape[0] for x in xs)
    W = -(-max_len // block_size)
    num_blocks = B * W + 3
    perm = torch.randperm(num_blocks).tolist()
    tables = [perm[b * W : (b + 1) * W] for b in range(B)]
    cache = ours.make_kv_cache(num_blocks, block_size, dtype=dtype, device=device)
    builder = MLAMetadataBuilder(
        num_heads=ours.num_heads, block_size=block_size, max_num_seqs=B, max_model_len=W * block_size,
        max_num_batched_tokens=sum(x.shape[0] for x in xs), device=device, decode_threshold=threshold,
        dtype=dtype, workspace_tokens=workspace_tokens, kv_entry=ours.kv_lora_rank + ours.qk_rope_head_dim,
        kv_lora_rank=ours.kv_lora_rank, kv_cache_dtype=ours.kv_cache_dtype,
    )  # fmt: skip
    done = [0] * B
    outs = [torch.zeros(x.shape[0], x.shape[1]) for x in xs]
    for step in schedule:
        reqs = sorted((b for b in range(B) if step[b]), key=lambda b: step[b] > threshold)  # decodes first
        rows, pos, slots, qsl, seq_lens = [], [], [], [0], []
        for b in reqs:
            c, n = done[b], step[b]
            rows.append(xs[b][c : c + n])
            pos.extend(range(c, c + n))
            slots.extend(tables[b][p // block_size] * block_size + p % block_size for p in range(c, c + n))
            qsl.append(qsl[-1] + n)
            seq_lens.append(c + n)
        qsl_t = torch.tensor(qsl, dtype=torch.int32)
        spec = BatchSpec(
            query_start_loc=qsl_t.to(device), query_start_loc_cpu=qsl_t,
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_table=torch.tensor([tables[b] for b in reqs], dtype=torch.int32, device=device),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device), num_reqs=len(reqs),
            num_actual_tokens=qsl[-1], max_query_len=max(step[b] for b in reqs), max_seq_len=max(seq_lens),
            seq_lens_cpu=torch.tensor(seq_lens, dtype=torch.int32),
        )  # fmt: skip
        md = builder.build(spec)
        x = torch.cat(rows).to(device=device, dtype=dtype)
        y = ours(torch.tensor(pos, device=device), x, cache, md).float().cpu()
        for i, b in enumerate(reqs):
            outs[b][done[b] : done[b] + step[b]] = y[qsl[i] : qsl[i + 1]]
            done[b] += step[b]
    return outs


# Ragged batch of 4 requests: step 1 prefills chunks, step 2 continues (context in cache: chunked
# prefill), then decodes, a verify step (qlen 3, the threshold), and a mixed step with a late prefill.
LENGTHS = (23, 9, 20, 17)
SCHEDULE = (
    (10, 6, 13, 0),  # prefill chunks, request 3 not yet admitted
    (11, 3, 1, 12),  # request 0 continues its prefill over 10 cached tokens; request 1's 3-token chunk
    #                  and request 2's decode take the decode path
    (1, 0, 3, 5),  # decode, verify (qlen 3 <= threshold), prefill with context
    (1, 0, 3, 0),
)


@pytest.mark.parametrize("block_size", pick(cpu=[1, 16], gpu=[64]), ids=lambda b: f"P{b}")
@pytest.mark.parametrize("q_lora_rank", [32, None], ids=["q_lora", "q_proj"])
def test_layer_matches_hf(device, block_size, q_lora_rank):
    cfg = hf_config(q_lora_rank=q_lora_rank)
    dtype = pick(cpu=torch.float32, gpu=torch.bfloat16)
    hf, ours = make_pair(cfg, dtype=dtype, device=device)
    xs = [torch.randn(n, cfg.hidden_size) for n in LENGTHS]
    # a 7-token workspace cuts request 0's 10-token context into 2 chunks (3 at block size 16: whole
    # blocks would not fit, so chunks are 7 tokens)
    outs = run_steps(ours, xs, SCHEDULE, block_size, device, threshold=3, workspace_tokens=7, dtype=dtype)
    # bf16 on the GPU: activations and weights keep 8 mantissa bits through q_b/kv_b/o projections over a
    # 512-wide latent; measured (CPU interpreter, bf16): max |err| 0.029 on |out| ~ 3, cos diff 3.6e-5
    tol = pick(cpu=(1e-4, 1e-4, 1e-7), gpu=(5e-2, 5e-2, 2e-4))
    for b, x in enumerate(xs):
        assert_close(f"request {b}", hf_outputs(hf, cfg, x), outs[b], *tol)


def test_layer_fp8_cache_matches_hf(device):
    """fp8 cache: looser tolerance (reason below); the exact-precision path is tested above."""
    cfg = hf_config()
    dtype = pick(cpu=torch.float32, gpu=torch.bfloat16)
    hf, ours = make_pair(cfg, kv_cache_dtype="fp8", dtype=dtype, device=device)
    xs = [torch.randn(n, cfg.hidden_size) for n in LENGTHS]
    outs = run_steps(ours, xs, SCHEDULE, 16, device, threshold=3, workspace_tokens=7, dtype=dtype)
    # e4m3 keeps 3 mantissa bits: each cached kv_c / k_pe element is off by up to 2^-4 of its value, so
    # scores and the value sum move by a few percent of the output scale (|out| ~ 1 here). Rows that
    # only see their own fresh tokens are exact; decode and context rows carry the rounding. Measured
    # max |err|: 0.05 (fp32 model), 0.09 (bf16 model).
    tol = pick(cpu=(0.1, 0.1, 5e-3), gpu=(0.15, 0.1, 5e-3))
    for b, x in enumerate(xs):
        assert_close(f"request {b}", hf_outputs(hf, cfg, x), outs[b], *tol)


@pytest.mark.parametrize("interleave", [True, False], ids=["interleave", "neox"])
@pytest.mark.parametrize("rope", ["default", "yarn", "linear"])
def test_rope_and_scale_match_hf(interleave, rope):
    params = {
        "default": {"rope_type": "default", "rope_theta": 10000.0},
        "yarn": {**YARN, "mscale": 0.707, "mscale_all_dim": 1.0, "factor": 40.0},  # attention_factor != 1
        "linear": {"rope_type": "linear", "rope_theta": 5000.0, "factor": 2.0},
    }[rope]
    cfg = hf_config(rope=params, interleave=interleave)
    hf = hf_v3.DeepseekV3Attention(cfg, layer_idx=0)
    assert mla_softmax_scale(96, cfg.rope_parameters) == pytest.approx(hf.scaling, rel=1e-12)
    T, H = 37, 3
    positions = torch.arange(T) * 5 + 3
    q_pe, k_pe = torch.randn(T, H, 64), torch.randn(T, 64)
    rot = RotaryEmbedding(64, cfg.max_position_embeddings, cfg.rope_parameters, interleave)
    q_out, k_out = rot(positions, q_pe, k_pe)
    cos, sin = hf_v3.DeepseekV3RotaryEmbedding(cfg)(q_pe[None], positions[None])
    apply = hf_v3.apply_rotary_pos_emb_interleave if interleave else hf_v3.apply_rotary_pos_emb
    q_ref, k_ref = apply(q_pe.transpose(0, 1)[None], k_pe[None, None], cos, sin)
    assert_close("q_pe", q_ref[0].transpose(0, 1), q_out, 1e-6, 1e-6, 1e-10)
    assert_close("k_pe", k_ref[0, 0], k_out, 1e-6, 1e-6, 1e-10)


def test_layer_validation():
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        MLAAttention(hidden_size=64, num_heads=2, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=32,
                     qk_rope_head_dim=64, v_head_dim=32, kv_cache_dtype="fp8_e5m2")  # fmt: skip
    layer = MLAAttention(hidden_size=64, num_heads=2, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=32,
                         qk_rope_head_dim=64, v_head_dim=32)  # fmt: skip
    with pytest.raises(TypeError, match="MLAMetadata"):
        layer(torch.zeros(3, dtype=torch.int64), torch.zeros(3, 64), torch.zeros(1, 1, 576), object())
    with pytest.raises(ValueError, match="unsupported|not supported"):
        RotaryEmbedding(64, 128, {"rope_type": "longrope"})
