"""DeepSeek V3.2 end to end: the fp8 paths measured against the exact path (issue 30 item 4).

Runs one random-weight V3.2 (2 layers, real attention widths: latent 512 + 64, 64 index heads x 128) through the
engine on the same prompts with each cache configuration, prompts fed whole (teacher forcing: one token
generated, chunked prefill on, so every configuration sees the same rows):

* ``exact``: bf16 model, bf16 MLA cache, bf16 indexer keys (what transformers computes, in bf16);
* ``fp8 indexer``: e4m3 index keys (block-split cache, UE8M0 scales) and e4m3 index queries (vLLM's fast path);
* ``fp8_ds_mla``: the 656-byte MLA cache rows;
* ``both``.

For each it reports the recall of the exact path's top-k (per layer, all rows: |fp8 set & exact set| / |exact
set|) and the logits' max / mean |difference| from the exact path, plus the exact path's own max |difference|
from transformers' fp32 ``DeepseekV32ForCausalLM``. A markdown table goes to stdout (and ``--out FILE``) for
benchmarks/RESULTS.md.

usage: python benchmarks/v32_fp8.py [--device cuda|cpu] [--out FILE]   (cpu: a tiny plumbing run)
"""

from __future__ import annotations

import argparse
import sys

import torch

import openmla  # noqa: F401  (sets the interpreter up without CUDA)
from openmla.engine import EngineConfig, LLMEngine, build_model, random_state_dict
from openmla.engine.models import tiny_v32_config
from openmla.engine.oracle import build_hf_model

# (config overrides, prompt lengths, block size, tokens per step) per device
GPU_SETUP = (dict(hidden_size=512, num_attention_heads=16, index_n_heads=64, index_head_dim=128, index_topk=512,
                  max_position_embeddings=8192), [3000, 1200, 700], 64, 2048)  # fmt: skip
CPU_SETUP = (dict(index_topk=8), [40, 17], 16, 32)
CONFIGS = {"exact": ("auto", "auto"), "fp8 indexer": ("auto", "fp8"), "fp8_ds_mla": ("fp8_ds_mla", "auto"),
           "both": ("fp8_ds_mla", "fp8")}  # fmt: skip


def _run(cfg, sd, prompts, device, dtype, kv, idx, block_size, budget):
    """Engine logits of every prompt row [rows, vocab] fp32 and per layer the top-k rows [rows, K] (step order)."""
    model = build_model(cfg, sd, device=device, dtype=dtype, kv_cache_dtype=kv, indexer_cache_dtype=idx)
    tops = {i: [] for i in range(len(model.attention_layers))}
    for i, attn in enumerate(model.attention_layers):
        orig = attn.index_topk_positions

        def hook(*a, _orig=orig, _i=i, **kw):
            t = _orig(*a, **kw)
            tops[_i].append(t[: a[4].num_actual_tokens].clone().cpu())
            return t

        attn.index_topk_positions = hook
    longest = max(prompts) + 2
    eng = LLMEngine(model, EngineConfig(block_size=block_size, max_num_seqs=len(prompts), record_logits=True,
                                        max_num_batched_tokens=budget, max_model_len=-(-longest // block_size) *
                                        block_size, cuda_graphs=False))  # fmt: skip
    g = torch.Generator().manual_seed(5)
    ids = [torch.randint(2, cfg.vocab_size, (n,), generator=g).tolist() for n in prompts]
    eng.generate(ids, 1)
    logits = torch.cat([r.logits for r in eng.records])
    return logits, {i: torch.cat(v) for i, v in tops.items()}, eng.records


def _recall(exact: torch.Tensor, other: torch.Tensor) -> float:
    hit = total = 0
    for a, b in zip(exact.tolist(), other.tolist()):
        sa = {p for p in a if p >= 0}
        hit += len(sa & {p for p in b if p >= 0})
        total += len(sa)
    return hit / max(total, 1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    overrides, prompts, block_size, budget = GPU_SETUP if dev.type == "cuda" else CPU_SETUP
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    cfg = tiny_v32_config(**overrides)
    sd = random_state_dict(cfg, seed=0, decisive_routing=True)
    results = {name: _run(cfg, sd, prompts, dev, dtype, kv, idx, block_size, budget)
               for name, (kv, idx) in CONFIGS.items()}  # fmt: skip
    ex_logits, ex_tops, ex_recs = results["exact"]
    hf = build_hf_model(cfg, sd, device=dev)
    with torch.no_grad():
        ref = torch.cat([hf(torch.tensor([r.context_ids + r.token_ids], device=dev)).logits[0, -len(r.token_ids):]
                         .float().cpu() for r in ex_recs])  # fmt: skip
    lines = [
        f"V3.2 fp8 paths vs the exact path ({dev.type}, {str(dtype).replace('torch.', '')}; prompts {prompts}, "
        f"index_topk {cfg.index_topk}, {cfg.index_n_heads} index heads x {cfg.index_head_dim}, block size "
        f"{block_size}); exact vs transformers fp32: max |logit diff| {float((ex_logits - ref).abs().max()):.3e}",
        "",
        "| path | top-k recall layer 0 | top-k recall layer 1 | max abs logit diff | mean abs logit diff |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, (logits, tops, _) in results.items():
        rec = [_recall(ex_tops[i], tops[i]) for i in sorted(tops)]
        d = (logits - ex_logits).abs()
        lines.append(f"| {name} | {rec[0]:.4f} | {rec[-1]:.4f} | {float(d.max()):.3e} | {float(d.mean()):.3e} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
