"""DeepSeek V4 end to end: the engine's logits and greedy tokens against transformers' DeepseekV4ForCausalLM.

The tiny model has all three layer types (sliding window 8, CSA ratio 4 with indexer top-k 4, HCA ratio 16),
so the window, the top-k and the compressed entries all matter within a few dozen tokens. Each prompt is
checked against transformers run on that prompt alone, unpadded (SPEC §13.2, trap 1). The indexer uses 8
heads so that exact score ties (all heads' relu at 0, trap 2) do not occur in these cases.

A bf16 model rounds the indexer's inputs, so where two candidates' fp32 scores nearly tie it may pick the other
one (CPU bf16 run: 1 row of 100, position 27: entries 0, 1, 3, 6 instead of 0, 1, 2, 6), and one swapped entry of
four moves that row's logits by up to ~1 (a random swap per row, fp32: 0.84 / 1.2 at the worst row), beyond any
bf16 tolerance. :class:`~openmla.engine.oracle.IndexerPicks` therefore checks the picks and the attention apart:
the engine's picks against transformers' own (all equal in fp32; at most a few near-tie rows in bf16), and the
logits against transformers run with the engine's picks (its indexer's output replaced by a forward hook).
"""

from __future__ import annotations

import pytest
import torch

import openmla.layers.v4 as v4_layer
from openmla.engine import EngineConfig, LLMEngine
from openmla.engine.models.deepseek_v4 import (
    DeepseekV4Config,
    build_hf_v4_model,
    build_v4_model,
    hf_v4_state_dict,
    random_v4_state_dict,
    tiny_v4_config,
)
from openmla.engine.oracle import IndexerPicks, check_records, hf_greedy, logit_tolerance
from openmla.utils import testing
from openmla.utils.testing import pick

DTYPE = pick(cpu=torch.float32, gpu=torch.bfloat16)
# Tolerances: the oracle's table (fp32, sparse_mla: measured max |diff| 3.1e-6). bf16 on the CPU (interpreter,
# decisive routing; `openmla demo --model tiny-v4 --dtype bfloat16 [--kv-cache-dtype fp8_v4]`): 0.041 / cos 1.2e-4
# with bf16 caches, 0.15 / 1.2e-3 with fp8_v4. The GPU configuration of test_v4_engine_matches_transformers on the CPU
# (bf16, a torch emulation of the GPU sparse kernel: bf16 P, 132-SM plan): 0.149 / cos 1.6e-4 against transformers'
# own picks (0.97 of the bound, one near-tie flip), 0.093 / cos 3.1e-4 with the engine's picks (IndexerPicks).
MAX_NEW = 5


def _prompts(lengths, seed=1, vocab=128):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


# 45: chunked (budget 16), decode crosses 48 (an HCA and a CSA entry); 13: decode crosses 16; 30: crosses 32.
PROMPTS = _prompts((45, 13, 30))


@pytest.fixture(scope="module")
def tiny(monkeypatch_module):
    cfg = tiny_v4_config()
    # bf16 (GPU): pin the top-k expert choice so that rounding cannot flip a route (hash layers are fixed anyway)
    sd = random_v4_state_dict(cfg, seed=0, decisive_routing=DTYPE != torch.float32)
    return cfg, sd, build_hf_v4_model(cfg, sd)


@pytest.fixture(scope="module")
def monkeypatch_module():
    # torch.topk for the indexer's threshold under the interpreter: the same result, faster on 2 CPU cores.
    mp = pytest.MonkeyPatch()
    if testing.suite_device().type == "cpu":
        mp.setattr(v4_layer, "INDEXER_TOPK_IMPL", "torch")
    yield mp
    mp.undo()


@pytest.fixture(scope="module")
def hf_tokens(tiny):
    """transformers' greedy tokens by full re-forward, checked against its own cached generate() first (trap 2:
    with top-k ties its chunked and full forwards could disagree; then the case would prove nothing)."""
    toks = hf_greedy(tiny[2], PROMPTS, MAX_NEW)
    for p, t in zip(PROMPTS, toks, strict=True):
        ids = torch.tensor([p], device=next(tiny[2].parameters()).device)
        gen = tiny[2].generate(ids, max_new_tokens=MAX_NEW, do_sample=False, min_new_tokens=MAX_NEW)
        assert gen[0, len(p) :].tolist() == t
    return toks


# bf16: rows whose indexer picks may differ from transformers' fp32 ones (near ties; CPU bf16 run: 1 of 100)
MAX_PICK_MISMATCH = 0.05


def make_engine(tiny, *, kv_cache_dtype="auto", record_picks=False, **kw):
    """An engine over the tiny V4; ``record_picks``: its CSA indexer picks recorded every step (``eng.picks``)."""
    cfg, sd, _ = tiny
    model = build_v4_model(cfg, sd, device=testing.suite_device(), dtype=DTYPE, kv_cache_dtype=kv_cache_dtype)
    opts = dict(block_size=16, max_num_seqs=3, max_num_batched_tokens=32, max_model_len=64, record_logits=True)
    opts.update(kw)
    picks = IndexerPicks(model, opts["max_num_batched_tokens"]) if record_picks else None  # before graph capture
    eng = LLMEngine(model, EngineConfig(**opts))
    if picks is not None:
        picks.attach(eng)
    eng.picks = picks
    return eng


def _check(tiny, eng, kv_cache_dtype="auto"):
    """The engine's picks against transformers' own, then its logits against transformers run with those picks."""
    res, mismatched, rows = eng.picks.check(tiny[2], eng.records, *logit_tolerance(DTYPE, kv_cache_dtype))
    print(f"indexer picks differing from transformers': {mismatched} of {rows} rows")
    assert rows > 0
    allowed = 0 if DTYPE == torch.float32 else MAX_PICK_MISMATCH * rows
    assert mismatched <= allowed, f"indexer picks differ from transformers' in {mismatched} of {rows} rows"
    assert res.ok, res.failures[:5]
    return res


def test_v4_engine_matches_transformers(tiny, hf_tokens):
    """Ragged batch: prefill, chunked prefill and decode crossing entry boundaries give transformers' logits; the
    SWA ring (48 tokens for a 16-token budget) wraps around for the longest request."""
    eng = make_engine(tiny, max_num_batched_tokens=16, record_picks=True)
    assert eng.runner.swa_ring_blocks * eng.config.block_size < len(PROMPTS[0]) + MAX_NEW
    outs = eng.generate(PROMPTS, MAX_NEW)
    recs = eng.records
    kinds = {
        "chunked prefill": any(len(r.context_ids) > 0 and len(r.token_ids) > 3 for r in recs),
        "prefill": any(len(r.context_ids) == 0 for r in recs),
        "decode": any(len(r.token_ids) == 1 and len(r.context_ids) > 0 for r in recs),
        "batched": max(len({r.req_id for r in recs if r.step == s}) for s in range(eng.stats.num_steps)) > 1,
    }
    assert all(kinds.values()), kinds
    res = _check(tiny, eng)
    print(f"{DTYPE} vs transformers: max |logit diff| {res.max_abs_diff:.3e}, cos diff {res.max_cos_diff:.2e}")
    if DTYPE == torch.float32:
        assert outs == hf_tokens
    if testing.suite_device().type == "cuda":  # decode steps replay CUDA graphs (metadata rebuilt in place)
        assert eng.stats.num_graph_replays > 0


def test_v4_verify_and_preemption(tiny, hf_tokens):
    """Speculative verify (rejected drafts roll the compressor ring back) under preemption and recompute."""
    eng = make_engine(
        tiny, block_size=4, num_blocks=10, num_spec_tokens=2, max_num_batched_tokens=24, record_picks=True
    )
    outs = eng.generate(PROMPTS[1:], MAX_NEW)
    assert eng.stats.num_preemptions > 0
    assert any(r.is_verify for r in eng.records)
    assert eng.stats.num_accepted_tokens < eng.stats.num_draft_tokens  # some drafts were rejected
    _check(tiny, eng)
    if DTYPE == torch.float32:
        assert outs == hf_tokens[1:]


def test_v4_other_ratios_match_transformers(monkeypatch_module):
    """CSA at ratio 8 (still two overlapping series, transformers' rule) and HCA at ratio 4 (one), 8-token blocks."""
    cfg = tiny_v4_config(compress_rates={"compressed_sparse_attention": 8, "heavily_compressed_attention": 4})
    sd = random_v4_state_dict(cfg, seed=2, decisive_routing=DTYPE != torch.float32)
    model = build_v4_model(cfg, sd, device=testing.suite_device(), dtype=DTYPE)
    eng = LLMEngine(model, EngineConfig(block_size=8, max_num_seqs=2, max_num_batched_tokens=16, max_model_len=48,
                                        record_logits=True, num_spec_tokens=2))  # fmt: skip
    eng.generate(_prompts((29, 10), seed=3), 4)
    res = check_records(build_hf_v4_model(cfg, sd), eng.records, *logit_tolerance(DTYPE, "auto"))
    assert res.ok, res.failures[:5]


def test_v4_checkpoint_served_by_the_cli(tiny, hf_tokens, tmp_path, capsys):
    """transformers' save_pretrained (DeepSeek names, per-expert w1/w2/w3) -> ``openmla generate --model DIR``."""
    import json

    from openmla.cli import main

    tiny[2].save_pretrained(str(tmp_path))
    ids = ",".join(map(str, PROMPTS[1]))
    args = ["generate", "--model", str(tmp_path), "--prompt-ids", ids, "--max-new-tokens", "4", "--json"]
    assert main(args + ["--device", testing.suite_device().type, "--dtype", "float32"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out == [hf_tokens[1][:4]]


def test_v4_config_roundtrip_and_errors():
    cfg = tiny_v4_config()
    again = DeepseekV4Config.from_dict(cfg.to_dict())
    assert again == cfg
    legacy = DeepseekV4Config.from_dict(
        {"model_type": "deepseek_v4", "num_hidden_layers": 3, "compress_ratios": [0, 4, 128], "num_hash_layers": 1}
    )
    assert legacy.layer_types == ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]
    assert legacy.mlp_layer_types == ["hash_moe", "moe", "moe"]
    legacy = DeepseekV4Config.from_dict({"num_hidden_layers": 2, "compress_rate_hca": 16, "compress_ratios": [4, 128]})
    assert legacy.compress_rates == {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16}
    with pytest.raises(ValueError, match="FP8 checkpoint"):
        hf_v4_state_dict(
            {"layers.0.attn.wq_a.weight": torch.zeros(1), "layers.0.attn.wq_a.scale_inv": torch.zeros(1)}, 1
        )
    with pytest.raises(ValueError, match="deepseek_v4"):
        DeepseekV4Config.from_dict({"model_type": "deepseek_v3"})
    with pytest.raises(ValueError, match="head_dim"):
        tiny_v4_config(head_dim=256)
    with pytest.raises(ValueError, match="layer_types"):
        tiny_v4_config(layer_types=["full_attention"] * 3)


def test_v4_spec_tokens_bounded_by_the_ring(tiny):
    with pytest.raises(ValueError, match="ring"):
        make_engine(tiny, num_spec_tokens=8)


def test_v4_engine_bf16_fp8_v4_caches():
    """bf16 model (decisive routing), fp8_v4 caches and fp8 indexer keys through the engine: every step's logits
    within the fp8_v4 tolerance of transformers' fp32 ones (the GPU runs the whole batch; the CPU two prompts)."""
    cfg = tiny_v4_config()
    sd = random_v4_state_dict(cfg, seed=0, decisive_routing=True)
    hf = build_hf_v4_model(cfg, sd)
    dev = testing.suite_device()
    model = build_v4_model(
        cfg, sd, device=dev, dtype=torch.bfloat16, kv_cache_dtype="fp8_v4", indexer_cache_dtype="fp8"
    )
    prompts, new = (PROMPTS, MAX_NEW) if dev.type == "cuda" else (PROMPTS[1:], 3)
    eng = LLMEngine(model, EngineConfig(block_size=16, max_num_seqs=3, max_num_batched_tokens=16, max_model_len=64,
                                        record_logits=True))  # fmt: skip
    eng.generate(prompts, new)
    res = check_records(hf, eng.records, *logit_tolerance(torch.bfloat16, "fp8_v4"))
    print(f"bf16 + fp8_v4 vs transformers fp32: max |diff| {res.max_abs_diff:.3e}, cos diff {res.max_cos_diff:.2e}")
    assert res.ok, res.failures[:5]


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["auto", "fp8_v4"])
def test_v4_demo_cuda(capsys, kv):
    """`openmla demo --model tiny-v4` on the GPU (bf16, CUDA graphs): the product's demo, its logits checked against
    transformers run on the engine's indexer picks (recorded through the graph replays)."""
    from openmla.cli import main as cli_main

    assert cli_main(["demo", "--device", "cuda", "--model", "tiny-v4", "--kv-cache-dtype", kv]) == 0
    out = capsys.readouterr().out
    assert "DeepSeek V4" in out and out.strip().endswith("OK")
