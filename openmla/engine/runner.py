"""Model runner: turns a scheduler step into tensors, a :class:`BatchSpec`, metadata and logits.

The runner owns the per-layer latent caches, the metadata builder and a set of persistent input
buffers (token ids, positions, slot mapping, query starts, sequence lengths, block table) that every
step is copied into, so a decode step can be captured once as a CUDA graph and replayed against the
same addresses.

CUDA graphs (GPU only): decode-only steps whose requests all have the same query length ``q`` (1, or
``1 + num_spec_tokens`` for speculative verify) are captured for batch sizes 1, 2, 4, ... up to
``max_num_seqs``. A smaller batch is padded to the next captured size with dummy requests of query
length 0 (``query_start_loc`` stays flat, slots -1, block 0); the metadata builder then applies the
uniform padding rule, giving the dummies ``q`` rows and ``seq_len = q``. Other steps run eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from openmla.engine.blocks import BlockManager
from openmla.engine.models.deepseek_v3 import DeepseekV3ForCausalLM
from openmla.engine.scheduler import SchedulerOutput
from openmla.metadata import BatchSpec, MLAMetadataBuilder

__all__ = ["ModelRunner", "StepInputs"]


@dataclass
class StepInputs:
    """Host-side description of a step's rows.

    Attributes:
        row_starts (list[int]): first row of each scheduled request (scheduler order).
        sample_rows (list[int]): rows whose logits are returned: for each sampling request, its last
            ``1 + len(draft_ids)`` rows; every row when the runner records all logits.
        num_tokens (int): real token rows.
    """

    row_starts: list[int]
    sample_rows: list[int]
    num_tokens: int


class ModelRunner:
    r"""Runs the model on scheduled steps over paged MLA caches.

    Args:
        model (DeepseekV3ForCausalLM): the model (weights loaded, on ``device``).
        block_manager (BlockManager): the blocks and tables shared with the scheduler.
        max_num_seqs (int), max_num_batched_tokens (int), max_model_len (int): engine limits.
        device (torch.device | str), dtype (torch.dtype): where and in what the model computes.
        num_spec_tokens (int): drafts per verify (decode threshold ``1 + num_spec_tokens``).
        cuda_graphs (bool): capture decode steps (CUDA devices only).
        workspace_tokens (int | None): chunked-context workspace rows (builder default when None).
    """

    def __init__(
        self,
        model: DeepseekV3ForCausalLM,
        block_manager: BlockManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        device: torch.device | str,
        dtype: torch.dtype,
        num_spec_tokens: int = 0,
        cuda_graphs: bool = False,
        workspace_tokens: int | None = None,
    ) -> None:
        self.model = model
        self.bm = block_manager
        self.device = torch.device(device)
        self.dtype = dtype
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.num_spec_tokens = num_spec_tokens
        self.block_size = block_manager.block_size
        self._init_attention(workspace_tokens)
        self.max_blocks_per_seq = self.builder.max_blocks_per_seq
        dev = self.device
        T, B, W = max_num_batched_tokens, max_num_seqs, self.max_blocks_per_seq
        self._input_ids = torch.zeros(T, dtype=torch.int64, device=dev)
        self._positions = torch.zeros(T, dtype=torch.int64, device=dev)
        self._slot_mapping = torch.full((T,), -1, dtype=torch.int64, device=dev)
        self._qsl = torch.zeros(B + 1, dtype=torch.int32, device=dev)
        self._seq_lens = torch.zeros(B, dtype=torch.int32, device=dev)
        self._block_table = torch.zeros(B, W, dtype=torch.int32, device=dev)
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._graph_pool = None
        self.cuda_graphs = bool(cuda_graphs) and self.device.type == "cuda"
        self.num_graph_replays = 0
        if self.cuda_graphs:
            self.capture_cuda_graphs()

    def _init_attention(self, workspace_tokens: int | None) -> None:
        """Set ``self.builder`` (the metadata builder) and ``self.kv_caches`` (one cache per attention layer)."""
        model, max_num_seqs, num_spec_tokens = self.model, self.max_num_seqs, self.num_spec_tokens
        max_model_len, max_num_batched_tokens, dtype = self.max_model_len, self.max_num_batched_tokens, self.dtype
        cfg = model.config
        num_blocks = self.bm.allocator.num_blocks
        if hasattr(model, "make_metadata_builder"):  # a model with its own attention backend (V3.2 sparse MLA)
            self.builder = model.make_metadata_builder(
                block_size=self.block_size, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                max_num_batched_tokens=max_num_batched_tokens, device=self.device, decode_threshold=1 + num_spec_tokens,
            )  # fmt: skip
            self.kv_caches = model.make_kv_caches(num_blocks, self.block_size, dtype=dtype, device=self.device)
        else:
            self.builder = MLAMetadataBuilder(
                num_heads=cfg.num_attention_heads,
                block_size=self.block_size,
                max_num_seqs=max_num_seqs,
                max_model_len=max_model_len,
                max_num_batched_tokens=max_num_batched_tokens,
                device=self.device,
                decode_threshold=1 + num_spec_tokens,
                dtype=dtype,
                kv_entry=cfg.kv_lora_rank + cfg.qk_rope_head_dim,
                kv_lora_rank=cfg.kv_lora_rank,
                workspace_tokens=workspace_tokens,
                kv_cache_dtype=model.attention_layers[0].kv_cache_dtype,
            )
            self.kv_caches = [
                attn.make_kv_cache(num_blocks, self.block_size, dtype=dtype, device=self.device)
                for attn in model.attention_layers
            ]

    # ----------------------------------------------------------- inputs
    def _fill(self, ids, pos, slots, qsl, seq_lens, tables, num_reqs_padded: int, num_rows: int):
        """Copy one step's host lists into the persistent buffers; return the CPU query starts and seq lens."""
        n, B = len(ids), len(seq_lens)
        W = self.max_blocks_per_seq
        ids_t = torch.zeros(num_rows, dtype=torch.int64)
        ids_t[:n] = torch.tensor(ids, dtype=torch.int64)
        pos_t = torch.zeros(num_rows, dtype=torch.int64)
        pos_t[:n] = torch.tensor(pos, dtype=torch.int64)
        slot_t = torch.full((num_rows,), -1, dtype=torch.int64)
        slot_t[:n] = torch.tensor(slots, dtype=torch.int64)
        qsl_t = torch.full((num_reqs_padded + 1,), qsl[-1], dtype=torch.int32)
        qsl_t[: B + 1] = torch.tensor(qsl, dtype=torch.int32)
        sl_t = torch.zeros(num_reqs_padded, dtype=torch.int32)
        sl_t[:B] = torch.tensor(seq_lens, dtype=torch.int32)
        bt_t = torch.zeros(num_reqs_padded, W, dtype=torch.int32)
        for i, t in enumerate(tables):
            bt_t[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
        nb = self.device.type == "cuda"
        self._input_ids[:num_rows].copy_(ids_t, non_blocking=nb)
        self._positions[:num_rows].copy_(pos_t, non_blocking=nb)
        self._slot_mapping[:num_rows].copy_(slot_t, non_blocking=nb)
        self._qsl[: num_reqs_padded + 1].copy_(qsl_t, non_blocking=nb)
        self._seq_lens[:num_reqs_padded].copy_(sl_t, non_blocking=nb)
        self._block_table[:num_reqs_padded].copy_(bt_t, non_blocking=nb)
        return qsl_t, sl_t

    def _spec(self, qsl_t, sl_t, num_reqs: int, num_actual: int, num_rows: int, max_qlen: int, max_seq: int):
        return BatchSpec(
            query_start_loc=self._qsl[: num_reqs + 1],
            query_start_loc_cpu=qsl_t,
            seq_lens=self._seq_lens[:num_reqs],
            block_table=self._block_table[:num_reqs],
            slot_mapping=self._slot_mapping[:num_rows],
            num_reqs=num_reqs,
            num_actual_tokens=num_actual,
            max_query_len=max_qlen,
            max_seq_len=max_seq,
            causal=True,
            seq_lens_cpu=sl_t,
            num_input_tokens=num_rows,
        )

    # --------------------------------------------------------------- run
    @torch.inference_mode()
    def execute(self, output: SchedulerOutput, *, all_logits: bool = False) -> tuple[torch.Tensor, StepInputs]:
        """Run one step.

        Args:
            output (SchedulerOutput): the scheduled requests (decodes first).
            all_logits (bool): return the logits of every row (for checks), not only sampled rows.

        Returns:
            (logits `[len(sample_rows), vocab]` of the model dtype, the step's row layout).
        """
        ids, pos, slots, qsl, seq_lens, tables, row_starts, sample_rows = [], [], [], [0], [], [], [], []
        for s in output.scheduled:
            req_id = s.request.req_id
            c, q = s.num_computed_tokens, s.query_len
            row_starts.append(qsl[-1])
            ids.extend(s.token_ids)
            pos.extend(range(c, c + q))
            slots.extend(self.bm.slot(req_id, p) for p in range(c, c + q))
            if all_logits:
                sample_rows.extend(range(qsl[-1], qsl[-1] + q))
            elif s.samples:
                sample_rows.extend(range(qsl[-1] + q - 1 - len(s.draft_ids), qsl[-1] + q))
            qsl.append(qsl[-1] + q)
            seq_lens.append(c + q)
            tables.append(self.bm.table(req_id))
        num_tokens = qsl[-1]
        B = len(seq_lens)
        qlens = {s.query_len for s in output.scheduled}
        max_qlen = max(qlens)
        info = StepInputs(row_starts=row_starts, sample_rows=sample_rows, num_tokens=num_tokens)

        key = self._graph_key(B, qlens)
        if key is not None:
            Bc, q = key
            qsl_t, sl_t = self._fill(ids, pos, slots, qsl, seq_lens, tables, Bc, Bc * q)
            spec = self._spec(qsl_t, sl_t, Bc, num_tokens, Bc * q, max_qlen, max(seq_lens))
            self.builder.build(spec)  # rewrites the persistent buffers the graph reads
            graph, logits = self._graphs[key]
            graph.replay()
            self.num_graph_replays += 1
            return logits[sample_rows], info

        qsl_t, sl_t = self._fill(ids, pos, slots, qsl, seq_lens, tables, B, num_tokens)
        spec = self._spec(qsl_t, sl_t, B, num_tokens, num_tokens, max_qlen, max(seq_lens))
        md = self.builder.build(spec)
        hidden = self.model(self._input_ids[:num_tokens], self._positions[:num_tokens], self.kv_caches, md)
        rows = torch.tensor(sample_rows, dtype=torch.int64, device=self.device)
        return self.model.compute_logits(hidden[rows]), info

    # -------------------------------------------------------- CUDA graphs
    def _capture_sizes(self, q: int) -> list[int]:
        sizes, b = [], 1
        while b <= self.max_num_seqs and b * q <= self.max_num_batched_tokens:
            sizes.append(b)
            b *= 2
        return sizes

    def _graph_key(self, num_reqs: int, qlens: set[int]) -> tuple[int, int] | None:
        if not self._graphs or len(qlens) != 1:
            return None
        (q,) = qlens
        if q > 1 + self.num_spec_tokens:
            return None
        fits = [b for (b, qq) in self._graphs if qq == q and b >= num_reqs]
        return (min(fits), q) if fits else None

    @torch.inference_mode()
    def capture_cuda_graphs(self) -> None:
        """Capture decode steps for every (batch size, query length) the engine may replay.

        Dummy capture batches attend to their own rows only (``seq_len = q``, block 0) and write
        nothing into the cache (slots -1).
        """
        qs = sorted({1, 1 + self.num_spec_tokens})
        self._graph_pool = torch.cuda.graph_pool_handle()
        for q in qs:
            for Bc in reversed(self._capture_sizes(q)):
                rows = Bc * q
                qsl = [i * q for i in range(Bc + 1)]
                pos = [p for _ in range(Bc) for p in range(q)]
                qsl_t, sl_t = self._fill([0] * rows, pos, [-1] * rows, qsl, [q] * Bc, [[0]] * Bc, Bc, rows)
                spec = self._spec(qsl_t, sl_t, Bc, rows, rows, q, q)
                md = self.builder.build(spec)
                ids, positions = self._input_ids[:rows], self._positions[:rows]
                self.model(ids, positions, self.kv_caches, md)  # warm-up: compiles kernels, caches constants
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self._graph_pool):
                    logits = self.model.compute_logits(self.model(ids, positions, self.kv_caches, md))
                self._graphs[(Bc, q)] = (graph, logits)
        torch.cuda.synchronize(self.device)
