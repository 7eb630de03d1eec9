"""Command line: ``openmla generate`` and ``openmla demo`` (also ``python -m openmla ...``).

``openmla generate --model PATH --prompt-ids 5,6,7 [--prompt-ids ...] --max-new-tokens N [--device cpu|cuda]
[--kv-cache-dtype auto|fp8|fp8_ds_mla] [--speculate K] [--json] [--dcp N [--dcp-interleave I]]``
    Greedy generation for a batch of token-id prompts. With ``--json`` the last line of stdout is a JSON
    list with one list of generated token ids per prompt (prompt excluded), in prompt order, exactly
    ``N`` each. ``--model tiny`` (the default) is the built-in seeded tiny DeepSeek V3, ``--model tiny-v32`` the
    tiny DeepSeek V3.2 (sparse attention), ``--model tiny-v4`` the tiny DeepSeek V4 (a checkpoint's ``model_type``
    picks V3, V3.2 or V4). ``--dcp N`` shards
    the KV cache over N ranks (decode context parallelism, ``openmla.parallel``): N local processes, or
    the ones ``torchrun --nproc-per-node N -m openmla generate --dcp N ...`` starts; rank 0 prints.

``openmla demo [--device cpu|cuda] [--model tiny|tiny-v32|tiny-v4|PATH] [--kv-cache-dtype auto|fp8|fp8_ds_mla|fp8_v4]
[--speculate K]``
    Builds the tiny DeepSeek V3 (V3.2 with ``tiny-v32``; or loads PATH), generates for a handful of prompts of
    different lengths with continuous batching, chunked prefill and speculative verify, prints tokens/s and the
    acceptance rate, checks each request's last step's logits against transformers and exits 1 on a mismatch.
    Sparse models (V3.2, V4) record the indexer's picks at every step: the demo prints how many positions' picks
    differ from transformers' own (a low-precision near tie can flip one; more than half fails,
    ``oracle.MAX_PICK_MISMATCH``) and checks the logits against transformers attending to the engine's picks
    (:class:`openmla.engine.oracle.IndexerPicks`).

``openmla bench [--family decode,prefill] [--shapes PRESET|SPECS] [--rep MS] [--out DIR] [--label L] [--no-peers]
[--quick]``
    Sweeps of the ops over DeepSeek shapes beside FlashMLA / cuDNN when importable: a printed table, CSV, JSON and
    (with the ``bench`` extra) PNG plots; see :mod:`openmla.bench`. Exit 1 when an openmla point failed.

Exit codes: 0 success, 1 logits mismatch (demo), 2 bad arguments or input.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

__all__ = ["main"]


def _device(name: str | None):
    import torch

    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available")
    return torch.device(name)


def _dtype(name: str, device):
    import torch

    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def _prompt_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(f"prompt ids must be comma-separated integers, got {text!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError("a prompt needs at least one token id")
    return ids


def _positive(text: str) -> int:
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def _non_negative(text: str) -> int:
    v = int(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {v}")
    return v


def _add_common(p: argparse.ArgumentParser, speculate_default: int) -> None:
    p.add_argument("--model", default="tiny",
                   help='checkpoint directory (HF config.json + safetensors), "tiny" (V3), "tiny-v32", '
                   '"tiny-v4"')  # fmt: skip
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda if present, else cpu")
    p.add_argument("--kv-cache-dtype", choices=("auto", "fp8", "fp8_ds_mla", "fp8_v4"), default="auto",
                   help="fp8: per-tensor (V3); fp8_ds_mla: 656-byte rows (V3.2); fp8_v4: 584 bytes (V4)")  # fmt: skip
    p.add_argument("--speculate", type=_non_negative, default=speculate_default, metavar="K",
                   help="draft tokens verified per step (n-gram prompt lookup)")  # fmt: skip
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto",
                   help="model dtype (auto: bfloat16 on cuda, float32 on cpu)")  # fmt: skip
    p.add_argument("--block-size", type=_positive, default=None, help="KV-cache block size (default 16 cpu, 64 cuda)")
    p.add_argument("--seed", type=int, default=0, help="seed of the tiny model's weights")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="openmla", description="openmla: paged MLA attention, tiny engine")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="greedy generation for token-id prompts")
    _add_common(g, 0)
    g.add_argument("--prompt-ids", type=_prompt_ids, action="append", required=True, metavar="IDS",
                   help="comma-separated token ids; repeat for a batch")  # fmt: skip
    g.add_argument("--max-new-tokens", type=_positive, required=True, metavar="N")
    g.add_argument("--json", action="store_true", help="print the generated ids as JSON on the last line")
    g.add_argument("--dcp", type=_positive, default=None, metavar="N",
                   help="decode context parallelism: the KV cache sharded over N ranks (N local processes, "
                   "or the processes of torchrun --nproc-per-node N); gloo on cpu, NCCL on cuda")  # fmt: skip
    g.add_argument("--dcp-interleave", type=_positive, default=1, metavar="I", help="DCP tokens per rank in turn")
    d = sub.add_parser("demo", help="generate with the tiny DeepSeek V3 and check against transformers")
    _add_common(d, 2)
    d.add_argument("--max-new-tokens", type=_positive, default=24, metavar="N")
    from openmla.bench.cli import add_arguments as _bench_arguments

    _bench_arguments(sub.add_parser("bench", help="benchmark sweeps beside FlashMLA / cuDNN (CSV, JSON, plots)"))
    return parser


def _make_engine(args, prompts: list[list[int]], max_new_tokens: int, *, record: bool = False, decisive: bool = False):
    """Load the model and size an engine for these prompts."""
    from openmla.engine import LLMEngine

    model, sd, dtype, cfg = _load_for_engine(args, prompts, max_new_tokens, record=record, decisive=decisive)
    if getattr(args, "dcp", None) is not None:  # inside a DCP rank (see _cmd_generate)
        from openmla.parallel.engine import dcp_engine

        return dcp_engine(model, cfg, interleave=args.dcp_interleave), sd, dtype
    return LLMEngine(model, cfg), sd, dtype


def _load_for_engine(args, prompts: list[list[int]], max_new_tokens: int, *, record: bool, decisive: bool):
    """Load the model and size an engine config for these prompts: (model, state dict, dtype, EngineConfig)."""
    from openmla.engine import EngineConfig, load_model

    device = _device(args.device)
    dtype = _dtype(args.dtype, device)
    model, sd = load_model(
        args.model, seed=args.seed, device=device, dtype=dtype, kv_cache_dtype=args.kv_cache_dtype,
        decisive_routing=decisive,
    )  # fmt: skip
    block_size = args.block_size or (64 if device.type == "cuda" else 16)
    longest = max(len(p) for p in prompts) + max_new_tokens + args.speculate
    max_model_len = min(model.config.max_position_embeddings, -(-longest // block_size) * block_size)
    if longest - args.speculate > max_model_len:
        raise ValueError(
            f"the longest prompt plus {max_new_tokens} new tokens exceeds the model's "
            f"{model.config.max_position_embeddings} positions"
        )
    cfg = EngineConfig(
        block_size=block_size,
        max_num_seqs=min(len(prompts), 4) if record else len(prompts),
        max_num_batched_tokens=32 if record else max(256, 1 + args.speculate),
        max_model_len=max_model_len,
        num_spec_tokens=args.speculate,
    )
    return model, sd, dtype, cfg


def _cmd_generate(args) -> int:
    rank = 0
    if args.dcp is not None:
        import torch.distributed as dist

        if not dist.is_initialized():  # start the ranks; each comes back here with its process group
            from openmla.parallel.launch import run_ranks

            return run_ranks(_cmd_generate, args, args.dcp)
        rank = dist.get_rank()
    prompts = args.prompt_ids
    engine, _, _ = _make_engine(args, prompts, args.max_new_tokens)
    outs = engine.generate(prompts, args.max_new_tokens)
    if args.dcp is not None:
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, outs)
        if any(o != outs for o in every):
            raise RuntimeError(f"DCP ranks generated different tokens: {every}")
        if rank:
            return 0
    for i, (p, o) in enumerate(zip(prompts, outs)):
        print(f"prompt {i} ({len(p)} tokens) -> {' '.join(map(str, o))}")
    st = engine.stats
    print(f"{st.num_generated_tokens} tokens in {st.elapsed_s:.2f} s ({st.tokens_per_s:.1f} tokens/s)", file=sys.stderr)
    if args.json:
        print(json.dumps(outs))
    return 0


class _Progress:
    """A one-line text progress bar on stderr."""

    def __init__(self, width: int = 30) -> None:
        self.width = width
        self.t0 = time.perf_counter()

    def __call__(self, done: int, total: int) -> None:
        frac = done / total if total else 1.0
        bar = "#" * int(frac * self.width)
        rate = done / max(time.perf_counter() - self.t0, 1e-9)
        end = "\n" if done >= total else ""
        line = f"\r  [{bar:<{self.width}}] {done}/{total} tokens ({rate:.1f} tok/s)"
        print(line, end=end, file=sys.stderr, flush=True)


def _demo_prompts(vocab: int) -> list[list[int]]:
    """Five prompts of 3..40 tokens; two repeat a pattern (prompt lookup finds drafts there)."""
    import torch

    g = torch.Generator().manual_seed(1234)
    rand = [torch.randint(2, vocab, (n,), generator=g).tolist() for n in (3, 11, 40)]
    pattern = torch.randint(2, vocab, (4,), generator=g).tolist()
    return [rand[0], pattern * 4, rand[1], rand[2], pattern[:3] * 2 + rand[0]]


def _cmd_demo(args) -> int:
    import torch

    from openmla.engine import LLMEngine
    from openmla.engine.oracle import MAX_PICK_MISMATCH, IndexerPicks, build_hf_model, check_records, logit_tolerance

    device = _device(args.device)
    dtype = _dtype(args.dtype, device)
    # Low precision: pin the MoE expert choice so that a rounding-level near-tie cannot flip a route.
    decisive = dtype != torch.float32 or args.kv_cache_dtype != "auto"
    from openmla.engine.loader import load_checkpoint, tiny_config
    from openmla.engine.models import DeepseekV32Config, tiny_v32_config
    from openmla.engine.models.deepseek_v4 import DeepseekV4Config, tiny_v4_config

    tiny = {"tiny": tiny_config, "tiny-v32": tiny_v32_config, "tiny-v4": tiny_v4_config}.get(args.model)
    mcfg = tiny() if tiny is not None else load_checkpoint(args.model)[0]
    family = "DeepSeek V3.2" if isinstance(mcfg, DeepseekV32Config) else "DeepSeek V3"
    family = "DeepSeek V4" if isinstance(mcfg, DeepseekV4Config) else family
    print(f"openmla demo: {family} ({args.model}) on {device}, {str(dtype).replace('torch.', '')}, "
          f"kv cache {args.kv_cache_dtype}, speculate {args.speculate}")  # fmt: skip
    t0 = time.perf_counter()
    prompts = _demo_prompts(mcfg.vocab_size)
    model, sd, dtype, ecfg = _load_for_engine(args, prompts, args.max_new_tokens, record=True, decisive=decisive)
    # Sparse models (V3.2, V4's CSA layers): record the indexer's picks, buffers in place before graph capture
    picks = IndexerPicks(model, ecfg.max_num_batched_tokens) if IndexerPicks.supports(model) else None
    engine = LLMEngine(model, ecfg)
    if picks is not None:
        picks.attach(engine)
    mc = engine.model.config
    print(f"  model: {mc.num_hidden_layers} layers, hidden {mc.hidden_size}, {mc.num_attention_heads} heads, "
          + (f"latent {mc.kv_lora_rank}+{mc.qk_rope_head_dim}, " if hasattr(mc, "kv_lora_rank") else
             f"layer types {'/'.join(t.split('_')[0] for t in mc.layer_types)}, window {mc.sliding_window}, ")
          + f"{mc.n_routed_experts} experts; "
          f"block size {engine.config.block_size}, budget {engine.config.max_num_batched_tokens} tokens/step, "
          f"{engine.config.max_num_seqs} seqs; cuda graphs {'on' if engine.runner.cuda_graphs else 'off'} "
          f"(setup {time.perf_counter() - t0:.1f} s)")  # fmt: skip
    print(f"  prompts of {', '.join(str(len(p)) for p in prompts)} tokens, {args.max_new_tokens} new tokens each")

    progress = _Progress()
    ids = [engine.add_request(p, args.max_new_tokens) for p in prompts]
    total = len(prompts) * args.max_new_tokens
    last = {}  # each request's rows of its last step
    while engine.has_unfinished():
        engine.records.clear()
        engine.step(record=True)
        last.update((r.req_id, r) for r in engine.records)
        progress(sum(len(engine.output_ids(r)) for r in ids), total)
    st = engine.stats
    for i, r in enumerate(ids):
        print(f"  prompt {i} ({len(prompts[i])} tokens) -> {' '.join(map(str, engine.output_ids(r)))}")
    print(f"  {st.num_generated_tokens} tokens in {st.num_steps} steps, {st.elapsed_s:.2f} s: "
          f"{st.tokens_per_s:.1f} tokens/s; preemptions {st.num_preemptions}, "
          f"graph replays {st.num_graph_replays}")  # fmt: skip
    if args.speculate:
        print(f"  speculative acceptance rate: {st.acceptance_rate:.1%} "
              f"({st.num_accepted_tokens} of {st.num_draft_tokens} drafts)")  # fmt: skip

    atol, rtol, cos_tol = logit_tolerance(dtype, args.kv_cache_dtype)
    hf = build_hf_model(engine.model.config, sd)
    over = ""
    if picks is None:
        check = check_records(hf, list(last.values()), atol, rtol, cos_tol)
    else:  # a low-precision near tie may flip a pick (an O(1) logit change): the logits over the engine's picks
        check, mismatched, compared = picks.check(hf, list(last.values()), atol, rtol, cos_tol, all_positions=True)
        print(f"  indexer picks differing from transformers': {mismatched} of {compared} rows "
              "(every position with more candidates than the top-k)")  # fmt: skip
        if mismatched > MAX_PICK_MISMATCH * compared:  # near ties flip a few; a wrong indexer most
            check.failures.append(f"indexer picks differ from transformers' in {mismatched} of {compared} rows "
                                  f"(more than {MAX_PICK_MISMATCH:.0%})")  # fmt: skip
        over = " (over the engine's indexer picks)"
    print(f"  last steps vs transformers {type(hf).__name__}{over}: {check.num_rows} rows, max |logit diff| "
          f"{check.max_abs_diff:.3e} (atol {atol}, rtol {rtol}), cos diff {check.max_cos_diff:.1e}")  # fmt: skip
    if not check.ok:
        print("MISMATCH:\n  " + "\n  ".join(check.failures), file=sys.stderr)
        return 1
    print("OK")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``openmla``; returns the exit code."""
    args = _parser().parse_args(argv)
    try:
        if args.command == "generate":
            return _cmd_generate(args)
        if args.command == "bench":
            from openmla.bench.cli import run as _bench

            return _bench(args)
        return _cmd_demo(args)
    except (ValueError, FileNotFoundError) as err:
        print(f"openmla {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
