"""The engine end to end against transformers' DeepseekV3ForCausalLM, and its parts on their own.

Logits are checked on every step (prefill, chunked prefill over cached context, decode, speculative
verify) for a ragged batch of prompts, with the same weights in the HF model (fp32 oracle).
"""

from __future__ import annotations

import pytest
import torch

from openmla.engine import (
    BlockAllocator,
    BlockManager,
    EngineConfig,
    LLMEngine,
    NgramDrafter,
    Request,
    Scheduler,
    build_model,
    load_checkpoint,
    load_model,
    random_state_dict,
    save_checkpoint,
    tiny_config,
)
from openmla.engine.loader import fuse_experts, unfuse_experts
from openmla.engine.oracle import build_hf_model, check_records, hf_greedy, logit_tolerance
from openmla.utils import testing
from openmla.utils.testing import on_gpu, pick

pytest.importorskip("transformers")

PROMPTS = [
    [7, 3, 9, 27, 101, 4, 8, 15, 16, 23, 42, 99, 12, 5, 77, 31, 64, 2, 90, 11, 3, 3, 58, 71, 19, 24, 36, 6, 13, 8],
    [5, 6],
    [40, 41, 42, 40, 41, 42, 40],  # repetitive: the n-gram drafter proposes from it
    [9],
    [100, 17, 33, 120, 64, 7, 7, 7, 80, 81, 82, 83, 3],
]
MAX_NEW = 6
DTYPE = pick(cpu=torch.float32, gpu=torch.bfloat16)
# Low precision pins the MoE expert choice: a rounding-level near-tie could flip a route and move a
# logit by O(1) without any attention error (see random_state_dict). The fp32 model routes freely.
DECISIVE = DTYPE != torch.float32


@pytest.fixture(scope="module")
def tiny():
    cfg = tiny_config()
    sd = random_state_dict(cfg, seed=0, decisive_routing=DECISIVE)
    return cfg, sd, build_hf_model(cfg, sd)


def make_engine(tiny, *, kv_cache_dtype="auto", dtype=DTYPE, state_dict=None, **kw):
    cfg, sd, _ = tiny
    model = build_model(cfg, state_dict or sd, device=testing.suite_device(), dtype=dtype,
                        kv_cache_dtype=kv_cache_dtype)  # fmt: skip
    opts = dict(block_size=16, max_num_seqs=3, max_num_batched_tokens=24, max_model_len=64, record_logits=True)
    opts.update(kw)
    return LLMEngine(model, EngineConfig(**opts))


# ------------------------------------------------------------------------ end to end
@pytest.mark.parametrize("block_size", pick(cpu=[1, 16], gpu=[64]), ids=lambda b: f"P{b}")
def test_engine_logits_match_hf(tiny, block_size):
    """Ragged batch: prefill, chunked prefill, decode and verify steps all give HF's logits."""
    eng = make_engine(tiny, block_size=block_size, num_spec_tokens=2)
    outs = eng.generate(PROMPTS, MAX_NEW)
    assert [len(o) for o in outs] == [MAX_NEW] * len(PROMPTS)
    recs = eng.records
    kinds = {
        "chunked prefill": any(len(r.context_ids) > 0 and len(r.token_ids) > 3 for r in recs),
        "prefill": any(len(r.context_ids) == 0 for r in recs),
        "decode": any(len(r.token_ids) == 1 and len(r.context_ids) > 0 for r in recs),
        "verify": any(r.is_verify for r in recs),
    }
    assert all(kinds.values()), kinds
    assert eng.stats.num_steps > 3 and max(len({r.req_id for r in recs if r.step == s}) for s in range(3)) > 1
    check = check_records(tiny[2], recs, *logit_tolerance(DTYPE, "auto"))
    assert check.ok, "\n".join(check.failures[:5])


def test_engine_fp8_kv_cache_matches_hf(tiny):
    """fp8 KV cache, with a decisive-routing model and the fp8 tolerance of LOGIT_TOLERANCES.

    Why looser: e4m3 keeps 3 mantissa bits, so every cached latent/rope element is off by up to 2^-4
    of its value; through the scores and the value sums that moves the logits by ~0.1 (fp32 model).
    The cosine bound still catches a wrong row or scale. Routing is pinned because such a perturbation
    can flip a near-tie expert choice and move a logit by O(1).
    """
    cfg, _, _ = tiny
    sd = random_state_dict(cfg, seed=0, decisive_routing=True)
    hf = build_hf_model(cfg, sd)
    eng = make_engine(tiny, kv_cache_dtype="fp8", state_dict=sd, num_spec_tokens=2)
    eng.generate(PROMPTS, 4)
    assert eng.runner.kv_caches[0].dtype == torch.float8_e4m3fn
    check = check_records(hf, eng.records, *logit_tolerance(DTYPE, "fp8"))
    assert check.ok, "\n".join(check.failures[:5])
    assert check.max_abs_diff > 1e-4  # the cache really is quantised


def _assert_greedy(hf, prompts, outs, exact):
    """Generated tokens equal HF greedy decoding (exactly in fp32; in bf16, allowing a different choice
    only where HF's top-2 logits are within the bf16 logit tolerance, continuing from our tokens)."""
    if exact:
        assert outs == hf_greedy(hf, prompts, len(outs[0]))
        return
    atol = logit_tolerance(DTYPE, "auto")[0]
    with torch.no_grad():
        for p, o in zip(prompts, outs):
            seq = list(p)
            for t in o:
                logits = hf(torch.tensor([seq])).logits[0, -1]
                assert t == int(logits.argmax()) or float(logits.max() - logits[t]) <= 2 * atol, (p, o)
                seq.append(t)


class _OracleDrafter:
    """Proposes the known greedy continuation, with every third proposal's second draft corrupted, so
    that verify steps see full acceptance, partial acceptance and rejection."""

    def __init__(self, prompts, continuations, vocab):
        self.known = [(list(p), list(c)) for p, c in zip(prompts, continuations)]
        self.vocab, self.calls = vocab, 0

    def propose(self, tokens, k):
        self.calls += 1
        for p, c in self.known:
            if tokens[: len(p)] == p and tokens[len(p) :] == c[: len(tokens) - len(p)]:
                d = c[len(tokens) - len(p) :][:k]
                if self.calls % 3 == 0 and len(d) > 1:
                    d[1] = (d[1] + 1) % self.vocab
                return d + [tokens[-1]] * (k - len(d))
        return [tokens[-1]] * k


def test_speculative_verify_equals_greedy(tiny):
    plain = make_engine(tiny, num_spec_tokens=0, record_logits=False)
    greedy = plain.generate(PROMPTS, 8)
    # prompt lookup (the default drafter): correct whatever it proposes
    ngram = make_engine(tiny, num_spec_tokens=3, record_logits=False)
    ngram_outs = ngram.generate(PROMPTS, 8)
    assert ngram.stats.num_draft_tokens > 0
    if DTYPE == torch.float32:
        assert ngram_outs == greedy
    # drafts that are often right: multi-token acceptance and partial rejection
    cfg = tiny[0]
    spec = make_engine(tiny, num_spec_tokens=3, record_logits=False)
    spec.scheduler.drafter = _OracleDrafter(PROMPTS, greedy, cfg.vocab_size)
    outs = spec.generate(PROMPTS, 8)
    st = spec.stats
    assert 0 < st.num_accepted_tokens < st.num_draft_tokens
    assert st.num_steps < plain.stats.num_steps  # accepted drafts saved steps
    if DTYPE == torch.float32:
        assert outs == greedy
    _assert_greedy(tiny[2], PROMPTS, outs, exact=DTYPE == torch.float32)


def test_preemption_recomputes_without_losing_requests(tiny):
    """A cache of 12 blocks of 4 tokens for 5 requests: requests get preempted and recomputed."""
    eng = make_engine(tiny, block_size=4, num_blocks=12, max_num_seqs=4, record_logits=False, num_spec_tokens=1)
    outs = eng.generate(PROMPTS, 8)
    assert eng.stats.num_preemptions > 0
    assert [len(o) for o in outs] == [8] * len(PROMPTS)
    assert eng.block_manager.num_free_blocks == 12  # everything freed at the end
    _assert_greedy(tiny[2], PROMPTS, outs, exact=DTYPE == torch.float32)


# --------------------------------------------------------------------------- loader
def test_checkpoint_roundtrip_and_hf_compat(tiny, tmp_path):
    cfg, sd, hf = tiny
    save_checkpoint(str(tmp_path), cfg, sd)
    cfg2, sd2 = load_checkpoint(str(tmp_path))
    assert cfg2 == cfg
    assert sd2.keys() == sd.keys() and all(torch.equal(sd[k], sd2[k]) for k in sd)
    assert fuse_experts(unfuse_experts(sd)).keys() == sd.keys()
    # transformers reads the directory we wrote (per-expert layout) into the same model
    from transformers import DeepseekV3ForCausalLM

    hf2 = DeepseekV3ForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        assert torch.allclose(hf2(ids).logits, hf(ids).logits, atol=1e-6)
    model, _ = load_model(str(tmp_path))
    assert model.config.num_hidden_layers == cfg.num_hidden_layers


def test_loader_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_checkpoint(str(tmp_path))
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ValueError, match="deepseek_v3"):
        load_checkpoint(str(tmp_path))


# ---------------------------------------------------------------------- allocator
def test_block_allocator():
    a = BlockAllocator(4)
    x = a.allocate(3)
    assert len(set(x)) == 3 and a.num_free == 1
    assert a.allocate(2) is None and a.num_free == 1  # all or nothing
    a.free(x[:2])
    assert a.num_free == 3
    with pytest.raises(ValueError, match="not allocated"):
        a.free([x[0]])
    with pytest.raises(ValueError):
        BlockAllocator(0)


def test_block_manager_tables_and_slots():
    bm = BlockManager(5, block_size=4)
    assert bm.ensure("a", 5) and len(bm.table("a")) == 2
    assert bm.ensure("a", 8) and len(bm.table("a")) == 2  # still fits
    assert bm.ensure("b", 12) and bm.num_free_blocks == 0
    assert not bm.ensure("c", 1) and bm.table("c") == []
    t = bm.table("a")
    assert bm.slot("a", 6) == t[1] * 4 + 2
    bm.free("a")
    assert bm.num_free_blocks == 2 and bm.table("a") == []


def test_ngram_drafter():
    d = NgramDrafter(max_ngram=3, pad=False)
    assert d.propose([1, 2, 3, 9, 1, 2, 3], 2) == [9, 1]  # continuation of the earlier "1 2 3"
    assert d.propose([5, 6, 7], 3) == []
    assert NgramDrafter().propose([5, 6, 7], 3) == [7, 7, 7]  # padded to k
    assert d.propose([4, 4], 0) == []


# ---------------------------------------------------------------------- scheduler
def _run_fake(sched: Scheduler, vocab=50, max_steps=500):
    """Drive a scheduler with a fake model whose greedy token is a function of the previous token."""
    steps = []
    for _ in range(max_steps):
        if not sched.has_unfinished():
            return steps
        out = sched.schedule()
        assert not out.is_empty
        steps.append(out)
        sampled = {}
        for s in out.scheduled:
            if s.samples:
                fed = s.token_ids
                last = fed[-1 - len(s.draft_ids) :]
                sampled[s.request.req_id] = [(t * 7 + 1) % vocab for t in last]
        sched.update(out, sampled)
    raise AssertionError("scheduler did not finish")


def _fake_expected(prompt, n, vocab=50):
    seq = list(prompt)
    for _ in range(n):
        seq.append((seq[-1] * 7 + 1) % vocab)
    return seq[len(prompt) :]


@pytest.mark.parametrize("spec", [0, 2])
def test_scheduler_budget_order_and_preemption(spec):
    bm = BlockManager(6, block_size=4)
    sched = Scheduler(bm, max_num_seqs=3, max_num_batched_tokens=8, max_model_len=32, num_spec_tokens=spec)
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [3], [4, 4, 4, 4, 4], [9, 8], [2] * 7]
    reqs = [Request(str(i), p, 6) for i, p in enumerate(prompts)]
    for r in reqs:
        sched.add_request(r)
    steps = _run_fake(sched)
    for out in steps:
        assert out.num_batched_tokens <= 8  # token budget
        assert len(out.scheduled) <= 3
        kinds = [s.request.num_tokens - s.num_computed_tokens == 1 for s in out.scheduled]
        assert kinds == sorted(kinds, reverse=True)  # decodes first
    assert sched.num_preemptions > 0
    chunked = [
        s for o in steps for s in o.scheduled if len(s.token_ids) > 1 and s.num_computed_tokens and not s.draft_ids
    ]
    assert chunked  # a prefill continued over cached context
    for r, p in zip(reqs, prompts):  # no request lost, every one complete and correct after recompute
        assert sched.finished[r.req_id] is r and r.output_ids == _fake_expected(p, 6)
    assert bm.num_free_blocks == 6 and not sched.running and not sched.waiting
    if spec:
        assert sched.num_accepted_tokens > 0


def test_scheduler_rejects_impossible_requests():
    sched = Scheduler(BlockManager(2, block_size=4), max_num_seqs=2, max_num_batched_tokens=8, max_model_len=16)
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add_request(Request("a", [1] * 10, 7))
    with pytest.raises(ValueError, match="blocks"):
        sched.add_request(Request("b", [1] * 6, 4))
    with pytest.raises(ValueError, match="empty"):
        sched.add_request(Request("c", [], 1))
    sched.add_request(Request("d", [1], 1))
    with pytest.raises(ValueError, match="duplicate"):
        sched.add_request(Request("d", [2], 1))


def test_engine_rejects_bad_tokens(tiny):
    eng = make_engine(tiny, record_logits=False)
    with pytest.raises(ValueError, match="vocabulary"):
        eng.add_request([1, 100000], 2)


# ---------------------------------------------------------------------- GPU only
@pytest.mark.gpu
@pytest.mark.parametrize("spec", [0, 2])
def test_cuda_graph_decode_matches_eager(tiny, spec):
    """Decode steps replayed from CUDA graphs (padded batches included) give the eager engine's tokens.

    fp32, so that GEMM algorithm choices that differ with the (padded) batch size cannot flip a
    near-tie argmax; the point here is the graph plumbing, not precision.
    """
    kw = dict(block_size=64, num_spec_tokens=spec, record_logits=False, dtype=torch.float32)
    eager = make_engine(tiny, cuda_graphs=False, **kw)
    graphed = make_engine(tiny, cuda_graphs=True, **kw)
    a = eager.generate(PROMPTS, 12)
    b = graphed.generate(PROMPTS, 12)
    assert graphed.stats.num_graph_replays > 0 and eager.stats.num_graph_replays == 0
    assert a == b
    assert on_gpu()


# -------------------------------------------------------------- model widths (issue 28, defect 1)
_DEFAULT_ROPE = {"rope_type": "default", "rope_theta": 10000.0}
# every kind of width the layouts allow: latent ranks, rope dims, head counts, v_head_dim != qk_nope_head_dim,
# no q LoRA, plain and YaRN rope (the tiny config's default)
WIDTHS = {
    "L16": dict(kv_lora_rank=16),
    "L32-R16": dict(kv_lora_rank=32, qk_rope_head_dim=16),
    "L64-R32-H3": dict(kv_lora_rank=64, qk_rope_head_dim=32, num_attention_heads=3),
    "L256-H1-V48": dict(kv_lora_rank=256, num_attention_heads=1, qk_nope_head_dim=16, v_head_dim=48),
    "L128-R8-noqlora-rope": dict(kv_lora_rank=128, qk_rope_head_dim=8, q_lora_rank=None, rope_parameters=_DEFAULT_ROPE),
    "L512-H8-V16": dict(num_attention_heads=8, qk_nope_head_dim=24, v_head_dim=16),
}


@pytest.mark.parametrize("name", list(WIDTHS))
def test_engine_model_widths_match_hf(name):
    """Prefill, chunked prefill, decode and verify logits against transformers for each model width."""
    cfg = tiny_config(**WIDTHS[name])
    sd = random_state_dict(cfg, seed=1, decisive_routing=DECISIVE)
    hf = build_hf_model(cfg, sd)
    model = build_model(cfg, sd, device=testing.suite_device(), dtype=DTYPE)
    eng = LLMEngine(model, EngineConfig(block_size=pick(16, 64), max_num_seqs=2, max_num_batched_tokens=16,
                                        max_model_len=64, num_spec_tokens=1, record_logits=True))  # fmt: skip
    prompts = [PROMPTS[0][:20], PROMPTS[2]]
    outs = eng.generate(prompts, 4)
    recs = eng.records
    assert any(len(r.token_ids) == 1 and r.context_ids for r in recs) and any(r.is_verify for r in recs)
    assert any(r.context_ids and len(r.token_ids) > 2 for r in recs)  # chunked prefill over cached context
    check = check_records(hf, recs, *logit_tolerance(DTYPE, "auto"))
    assert check.ok, "\n".join(check.failures[:5])
    _assert_greedy(hf, prompts, outs, exact=DTYPE == torch.float32)


def test_engine_small_width_fp8_cache_matches_hf():
    """An fp8 cache at a padded width (latent 32, rope 16), with the fp8 tolerance of LOGIT_TOLERANCES."""
    cfg = tiny_config(kv_lora_rank=32, qk_rope_head_dim=16)
    sd = random_state_dict(cfg, seed=1, decisive_routing=True)
    model = build_model(cfg, sd, device=testing.suite_device(), dtype=DTYPE, kv_cache_dtype="fp8")
    eng = LLMEngine(model, EngineConfig(block_size=pick(16, 64), max_num_seqs=2, max_num_batched_tokens=16,
                                        max_model_len=64, num_spec_tokens=1, record_logits=True))  # fmt: skip
    eng.generate([PROMPTS[0][:18], PROMPTS[1]], 4)
    assert eng.runner.kv_caches[0].dtype == torch.float8_e4m3fn
    check = check_records(build_hf_model(cfg, sd), eng.records, *logit_tolerance(DTYPE, "fp8"))
    assert check.ok, "\n".join(check.failures[:5])


@pytest.mark.parametrize("field,value", [("kv_lora_rank", 384), ("kv_lora_rank", 2048), ("qk_rope_head_dim", 48)])
def test_model_width_refused_at_load(field, value):
    with pytest.raises(ValueError, match=f"{field} {value}: "):
        load_model(config_overrides={field: value})
