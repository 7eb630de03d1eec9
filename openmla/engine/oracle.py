"""The transformers oracle: HF's ``DeepseekV3ForCausalLM`` with the engine's weights, and the comparison.

A causal LM's logits at position ``p`` depend only on tokens ``0..p``, so each engine step can be checked
on its own: for every request, the HF model runs on the tokens the engine had cached plus the tokens
it fed (own tokens and drafts) and its last rows must match the engine's rows. This covers prefill,
chunked prefill (context from the cache), decode and speculative verify alike. Sparse models (V3.2, V4's CSA
layers) are checked over the keys the engine's indexer picked (:class:`IndexerPicks`): a low-precision near tie
may swap one, which no logit tolerance absorbs.

``transformers`` is imported lazily (it is a test/demo dependency, not a runtime one).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from openmla.engine.generate import StepRecord
from openmla.engine.models.deepseek_v3 import DeepseekV3Config

__all__ = [
    "LOGIT_TOLERANCES",
    "MAX_PICK_MISMATCH",
    "IndexerPicks",
    "LogitCheck",
    "build_hf_model",
    "check_records",
    "hf_greedy",
    "logit_tolerance",
]

# (atol, rtol, cosine-difference bound) for engine logits vs the fp32 HF oracle, keyed by
# (model dtype, kv_cache_dtype). Measured on the tiny model (|logits| <= ~4) with a margin of 2-3x:
#  * fp32: the kernels accumulate in fp32 in a different order than eager PyTorch: ~4e-6.
#  * bf16: activations and weights rounded to 8 mantissa bits through 2 layers: ~0.06.
#  * fp8 KV (e4m3, 3 mantissa bits): every cached latent and rope element carries up to 2^-4 relative
#    rounding error; through the scores and the value sum it moves the logits by ~0.13 in fp32 and
#    ~0.2 in bf16. This is the format's precision, not an attention error; the cosine bound still
#    catches a wrong cache row or a wrong scale.
LOGIT_TOLERANCES = {
    (torch.float32, "auto"): (1e-4, 1e-4, 1e-8),
    (torch.bfloat16, "auto"): (0.15, 0.05, 1e-3),
    (torch.float16, "auto"): (0.05, 0.02, 1e-4),
    (torch.float32, "fp8"): (0.4, 0.1, 5e-3),
    (torch.bfloat16, "fp8"): (0.5, 0.1, 1e-2),
    (torch.float16, "fp8"): (0.5, 0.1, 1e-2),
    # V3.2's fp8_ds_mla rows (one fp32 scale per 128 latent values, bf16 rope): no worse than per-tensor fp8
    (torch.float32, "fp8_ds_mla"): (0.4, 0.1, 5e-3),
    (torch.bfloat16, "fp8_ds_mla"): (0.5, 0.1, 1e-2),
    # V4's fp8_v4 rows (UE8M0 scale per 64 nope values, bf16 rope; bf16 attention only): 0.15 / cos 1.2e-3 on the
    # tiny V4 (CPU interpreter, decisive routing); not yet measured on the H200
    (torch.bfloat16, "fp8_v4"): (0.5, 0.1, 1e-2),
}


#: The most of the positions with a real choice (more visible keys than the top-k) whose indexer picks may differ
#: from transformers' own before ``openmla demo`` fails. Low-precision near ties flip some (CPU demo, bf16: tiny V4
#: 4 of 99, tiny V3.2 18 of 154; the V3.2 tests allow up to 20% in bf16 / fp8); a wrong indexer (its logits still
#: match transformers over its own picks) flips nearly all: 100% with its weights negated. A coarse guard only: the
#: fp32 tests require transformers' exact picks.
MAX_PICK_MISMATCH = 0.5


def logit_tolerance(dtype: torch.dtype, kv_cache_dtype: str) -> tuple[float, float, float]:
    """(atol, rtol, cos_tol) for the logits of a model in ``dtype`` with a ``kv_cache_dtype`` cache."""
    return LOGIT_TOLERANCES[(dtype, kv_cache_dtype)]


def build_hf_model(cfg: DeepseekV3Config, state_dict: dict, *, device: str | torch.device = "cpu"):
    """HF ``DeepseekV3ForCausalLM`` (``DeepseekV32ForCausalLM`` for a V3.2 config; eager attention, fp32, eval)
    with ``state_dict`` loaded strictly."""
    from openmla.engine.models.deepseek_v4 import DeepseekV4Config, build_hf_v4_model
    from openmla.engine.models.deepseek_v32 import DeepseekV32Config

    if isinstance(cfg, DeepseekV4Config):
        return build_hf_v4_model(cfg, state_dict, device=device)
    if isinstance(cfg, DeepseekV32Config):
        from transformers import DeepseekV32Config as HFConfig
        from transformers import DeepseekV32ForCausalLM as DeepseekV3ForCausalLM
    else:
        from transformers import DeepseekV3Config as HFConfig
        from transformers import DeepseekV3ForCausalLM

    d = cfg.to_dict()
    d.pop("architectures", None)
    d.pop("model_type", None)
    hf_cfg = HFConfig(**d)
    hf_cfg._attn_implementation = "eager"
    model = DeepseekV3ForCausalLM(hf_cfg)
    sd = {k: v.float() for k, v in state_dict.items()}
    if cfg.tie_word_embeddings:
        sd.setdefault("lm_head.weight", sd["model.embed_tokens.weight"])
    model.load_state_dict(sd, strict=True)
    return model.to(device).float().eval()


@torch.no_grad()
def hf_greedy(hf_model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Plain greedy decoding with the HF model (full recompute each token; tiny models only)."""
    dev = next(hf_model.parameters()).device
    outs = []
    for p in prompts:
        seq = list(p)
        for _ in range(max_new_tokens):
            seq.append(int(hf_model(torch.tensor([seq], device=dev)).logits[0, -1].argmax()))
        outs.append(seq[len(p) :])
    return outs


@dataclass
class LogitCheck:
    """Result of :func:`check_records`."""

    max_abs_diff: float
    max_cos_diff: float
    num_rows: int
    failures: list[str]

    @property
    def ok(self) -> bool:
        return not self.failures


@torch.no_grad()
def check_records(
    hf_model, records: list[StepRecord], atol: float, rtol: float, cos_tol: float, *, reference=None
) -> LogitCheck:
    """Compare recorded engine logits with the HF model's on the same token sequences.

    Args:
        hf_model: from :func:`build_hf_model`.
        records (list[StepRecord]): the engine's recorded rows.
        atol, rtol (float): per element ``|engine - hf| <= atol + rtol * |hf|``.
        cos_tol (float): bound on ``1 - 2<a,b>/(|a|^2 + |b|^2)`` per record.
        reference (Callable[[StepRecord], torch.Tensor] | None): the reference logits of a record's rows
            (`[len(token_ids), vocab]`) instead of the HF model's plain forward (:meth:`IndexerPicks.hf_logits`).

    Returns:
        LogitCheck: the largest differences and a message per failing record.
    """
    dev = next(hf_model.parameters()).device
    max_abs = max_cos = 0.0
    rows = 0
    failures = []
    for r in records:
        if reference is None:
            seq = r.context_ids + r.token_ids
            ref = hf_model(torch.tensor([seq], device=dev)).logits[0, -len(r.token_ids) :].double().cpu()
        else:
            ref = reference(r).double().cpu()
        out = r.logits.double()
        err = (out - ref).abs()
        denom = (ref * ref).sum() + (out * out).sum()
        cos = float(1 - 2 * (ref * out).sum() / denom) if denom > 0 else 0.0
        max_abs, max_cos = max(max_abs, float(err.max())), max(max_cos, cos)
        rows += len(r.token_ids)
        if not bool((err <= atol + rtol * ref.abs()).all()) or not torch.isfinite(out).all() or cos > cos_tol:
            failures.append(
                f"request {r.req_id} at position {len(r.context_ids)} ({len(r.token_ids)} rows"
                f"{', verify' if r.is_verify else ''}): max |diff| {float(err.max()):.3e}, cos diff {cos:.2e}"
            )
    return LogitCheck(max_abs_diff=max_abs, max_cos_diff=max_cos, num_rows=rows, failures=failures)


def _sparse_layers(model) -> dict[int, tuple[object, int]]:
    """``{layer index: (attention layer, tokens per key)}`` of the layers that attend to an indexer's top-k:
    V3.2's sparse MLA layers (keys are tokens: 1) and V4's CSA layers (keys are compressed entries: the ratio)."""
    from openmla.layers.sparse_mla import SparseMLAAttention
    from openmla.layers.v4 import DeepseekV4Attention

    found = {}
    for i, attn in enumerate(getattr(model, "attention_layers", [])):
        if isinstance(attn, SparseMLAAttention):
            found[i] = (attn, 1)
        elif isinstance(attn, DeepseekV4Attention) and attn.is_csa:
            found[i] = (attn, attn.ratio)
    return found


class IndexerPicks:
    """The keys an engine's indexer picked, by (layer, request, position), and transformers run on them.

    In low precision the lightning indexer's scores carry rounding, so where two candidates nearly tie at the
    k-th score the engine may pick the other one; one swapped key moves that row's logits by O(1) (the sparse
    model's sensitivity, not an attention error), beyond any tolerance. This checks the picks and the attention
    apart: how many rows' picks differ from transformers' own, and the logits against transformers run with the
    engine's picks forced into its indexer (its output replaced by a forward hook on every ``DeepseekV32Indexer``
    / ``DeepseekV4Indexer``).

    Recording wraps, per instance, the hook method of every sparse layer (V3.2:
    :meth:`~openmla.layers.sparse_mla.SparseMLAAttention.index_topk_positions`, request-local token positions;
    V4 CSA: :meth:`~openmla.layers.v4.DeepseekV4Attention.index_topk_entries`, request-local compressed entries)
    with a device-side copy into a persistent buffer per layer, so CUDA graphs captured after it record on replay
    too; :meth:`attach` wraps the runner's ``execute`` to read the buffers back after every step. Usage::

        picks = IndexerPicks(model, cfg.max_num_batched_tokens)  # before LLMEngine: it captures the graphs
        engine = LLMEngine(model, cfg)
        picks.attach(engine)
        ...  # engine.step(record=True) / engine.generate(...)
        check, mismatched, rows = picks.check(hf_model, engine.records, *logit_tolerance(dtype, kv_cache_dtype))

    Args:
        model: an engine model with sparse (V3.2) or CSA (V4) layers (:meth:`supports`).
        max_rows (int): the most rows a step runs (the engine's ``max_num_batched_tokens``).

    Raises:
        ValueError: the model has no such layers.
    """

    def __init__(self, model, max_rows: int) -> None:
        self.layers = _sparse_layers(model)
        if not self.layers:
            raise ValueError(f"{type(model).__name__} has no layers attending to an indexer's top-k")
        self.model, self.max_rows = model, int(max_rows)
        # (layer, req_id, position) -> [(step, picks [topk] int32, CPU)]; a position is fed again after a
        # rejected draft or a preemption, and a record reads the picks of the latest step up to its own
        self.rows: dict[tuple[int, str, int], list[tuple[int, torch.Tensor]]] = {}
        self.bufs: dict[int, torch.Tensor] = {}
        for i, (attn, _) in self.layers.items():
            name = "index_topk_entries" if hasattr(attn, "index_topk_entries") else "index_topk_positions"
            dev = next(attn.parameters()).device
            buf = torch.full((self.max_rows, attn.index_topk), -1, dtype=torch.int32, device=dev)
            real = getattr(attn, name)

            def wrapped(*args, _f=real, _buf=buf, **kw):
                out = _f(*args, **kw)
                _buf[: out.shape[0], : out.shape[1]].copy_(out)
                return out

            setattr(attn, name, wrapped)  # an instance attribute: only this layer, the class untouched
            self.bufs[i] = buf

    @staticmethod
    def supports(model) -> bool:
        """Whether ``model`` has layers whose picks this records (V3.2, V4 with CSA layers; not V3)."""
        return bool(_sparse_layers(model))

    def attach(self, engine) -> None:
        """Record after every step of ``engine`` (built on this model after this object)."""
        if engine.model is not self.model or engine.config.max_num_batched_tokens > self.max_rows:
            raise ValueError("attach to an engine over the same model with at most max_rows rows a step")
        runner, execute = engine.runner, engine.runner.execute

        def recording_execute(output, **kw):
            logits, info = execute(output, **kw)
            step = engine.stats.num_steps  # the step its records get
            got = {i: b[: info.num_tokens].to("cpu", copy=True) for i, b in self.bufs.items()}
            for s, r0 in zip(output.scheduled, info.row_starts, strict=True):
                for j in range(s.query_len):
                    for i, rows in got.items():
                        key = (i, s.request.req_id, s.num_computed_tokens + j)
                        self.rows.setdefault(key, []).append((step, rows[r0 + j]))
            return logits, info

        runner.execute = recording_execute

    def selection(self, rec: StepRecord) -> dict[int, torch.Tensor]:
        """The picks each sparse layer used for the positions of ``rec``'s sequence, as of its step.

        Returns:
            dict[int, torch.Tensor]: layer index -> `[len(context_ids) + len(token_ids), topk]` int64 (CPU); row
            ``p`` the picks position ``p`` got at the latest step up to ``rec.step`` that fed it.

        Raises:
            ValueError: a position with no recorded picks, or picks that are not ``min(topk, visible)``
                increasing keys it may see (V3.2: positions ``<= p``; V4: entries ``< (p + 1) // r``) then -1.
        """
        n = len(rec.context_ids) + len(rec.token_ids)
        out = {}
        for layer, (attn, r) in self.layers.items():
            rows = []
            for p in range(n):
                hist = [x for st, x in self.rows.get((layer, rec.req_id, p), []) if st <= rec.step]
                if not hist:
                    raise ValueError(f"no indexer picks recorded for layer {layer} position {p} by step {rec.step}")
                row, visible = hist[-1], (p + 1) // r
                k = min(attn.index_topk, visible)
                ok = bool(row[k:].eq(-1).all()) and (k == 0 or (int(row[0]) >= 0 and int(row[k - 1]) < visible))
                if not (ok and bool(row[:k].diff().gt(0).all())):
                    raise ValueError(f"layer {layer} position {p}: invalid picks {row.tolist()} ({visible} visible)")
                rows.append(row)
            out[layer] = torch.stack(rows).long()
        return out

    def _hf_indexers(self, hf_model) -> dict[int, torch.nn.Module]:
        mods = {}
        for name, m in hf_model.named_modules():
            if type(m).__name__ in ("DeepseekV32Indexer", "DeepseekV4Indexer"):
                mods[int(name.split("layers.")[1].split(".")[0])] = m
        if sorted(mods) != sorted(self.layers):
            raise ValueError(f"HF indexers in layers {sorted(mods)}, the engine's sparse layers {sorted(self.layers)}")
        return mods

    @torch.no_grad()
    def hf_logits(self, hf_model, rec: StepRecord, *, all_positions: bool = False) -> tuple[torch.Tensor, int, int]:
        """The HF model's logits for ``rec``'s rows with the engine's picks (:meth:`selection`) forced into its
        indexers (a forward hook replaces each one's output).

        Args:
            all_positions (bool): count the picks of every position of ``rec``'s sequence where some sparse layer
                chooses (sees more keys than its top-k), not only of ``rec``'s rows.

        Returns:
            (torch.Tensor, int, int): logits `[len(token_ids), vocab]` (fp32, CPU), the number of rows whose picks
            differ from the HF indexer's own (as sets) in some sparse layer, the number of rows compared.

        Raises:
            ValueError: as :meth:`selection`; or the HF model's indexers are not in the engine's sparse layers.
        """
        sel, first = self.selection(rec), 0 if all_positions else len(rec.context_ids)
        differ, compared = set(), set()  # positions whose picks differ in some layer, positions compared

        def hook(layer):
            def fn(module, args, out):
                forced, r = sel[layer][:, : out.shape[-1]], self.layers[layer][1]  # HF's width (V3.2: min(k, S))
                for p in range(first, forced.shape[0]):
                    if all_positions and (p + 1) // r <= self.layers[layer][0].index_topk:
                        continue  # every visible key picked: nothing to choose
                    compared.add(p)
                    own = {i for i in out[0, p].tolist() if 0 <= i < (p + 1) // r}  # HF pads: -1 or masked keys
                    if own != {i for i in forced[p].tolist() if i >= 0}:
                        differ.add(p)
                if r == 1:  # V3.2's top-k has no padding: a row that sees fewer keys repeats its own position
                    forced = torch.where(forced >= 0, forced, torch.arange(forced.shape[0])[:, None])
                return forced[None].to(device=out.device, dtype=out.dtype)

            return fn

        handles = [m.register_forward_hook(hook(layer)) for layer, m in self._hf_indexers(hf_model).items()]
        try:
            dev = next(hf_model.parameters()).device
            ids = torch.tensor([rec.context_ids + rec.token_ids], device=dev)
            logits = hf_model(ids).logits[0, -len(rec.token_ids) :].float().cpu()
        finally:
            for h in handles:
                h.remove()
        return logits, len(differ), len(compared) if all_positions else len(rec.token_ids)

    def check(
        self, hf_model, records: list[StepRecord], atol: float, rtol: float, cos_tol: float, *, all_positions=False
    ):
        """:func:`check_records` against the HF model attending, in every sparse layer and at every position, to
        the keys the engine picked there (:meth:`hf_logits`).

        Args:
            all_positions (bool): as :meth:`hf_logits` (every choosing position of the records' sequences).

        Returns:
            (LogitCheck, int, int): the logits check (a record whose picks are missing or invalid fails too), the
            number of rows whose picks differ from transformers' own in some layer, the rows compared (the records'
            rows, or with ``all_positions`` the choosing positions of their sequences).
        """
        self._hf_indexers(hf_model)
        counts, failures, valid = [0, 0], [], []
        for r in records:
            try:
                self.selection(r)
                valid.append(r)
            except ValueError as err:
                failures.append(f"request {r.req_id} at position {len(r.context_ids)}: {err}")

        def reference(r):
            logits, mismatched, compared = self.hf_logits(hf_model, r, all_positions=all_positions)
            counts[0] += mismatched
            counts[1] += compared
            return logits

        res = check_records(hf_model, valid, atol, rtol, cos_tol, reference=reference)
        return LogitCheck(res.max_abs_diff, res.max_cos_diff, res.num_rows, failures + res.failures), *counts
