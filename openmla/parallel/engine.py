"""DCP in openmla's engine: a rank-aware block manager, the DCP attention hook, and a DCP engine.

Every rank runs the whole model (no tensor parallelism: the same weights and the same hidden states on
every rank) and the same scheduler, so every rank schedules the same steps. What differs per rank is its
KV cache: a request's global position ``g`` is cached only on rank ``(g // I) % W``
(:class:`DCPBlockManager` allocates only those local blocks and maps other tokens to slot -1), and the
attention layers read it through :func:`~openmla.parallel.dcp_mla_decode` (replicated heads: the merge is
an all-reduce, every rank gets every head) and :func:`~openmla.parallel.dcp_mla_prefill_with_context`.
"""

from __future__ import annotations

import torch

from openmla.engine.blocks import BlockManager
from openmla.layers.mla import MLAAttention
from openmla.metadata.dense import MLADecodeMetadata, MLAPrefillMetadata
from openmla.parallel.comm import group_info
from openmla.parallel.dcp import dcp_mla_decode
from openmla.parallel.prefill import dcp_mla_prefill_with_context
from openmla.parallel.sharding import _local, check_dcp_args

__all__ = ["DCPBlockManager", "DCPMLAAttention", "enable_dcp", "dcp_engine"]


class DCPBlockManager(BlockManager):
    r"""Block tables of one DCP rank: only the blocks for the tokens this rank owns.

    Admission is decided on the busiest rank's count (rank 0 owns the most tokens of any prefix), charged
    against a shared budget of ``num_blocks``, so every rank takes the same scheduling decisions although
    each allocates only its own (fewer or equal) blocks.

    Args:
        num_blocks (int): blocks in this rank's cache. block_size (int): tokens per block.
        world_size (int), rank (int), interleave (int): the sharding (``openmla.parallel.sharding``).
    """

    def __init__(self, num_blocks: int, block_size: int, world_size: int, rank: int, interleave: int = 1) -> None:
        super().__init__(num_blocks, block_size)
        self.world_size, self.rank, self.interleave = check_dcp_args(world_size, rank, interleave)
        self._charged: dict[str, int] = {}  # blocks charged to each request (the busiest rank's count)
        self._num_charged = 0

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_blocks - self._num_charged

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks the busiest rank (rank 0) needs for ``num_tokens`` global tokens."""
        return -(-_local(num_tokens, self.world_size, 0, self.interleave) // self.block_size)

    def ensure(self, req_id: str, num_tokens: int) -> bool:
        """Grow ``req_id``'s local table to hold its share of ``num_tokens`` tokens; False if the budget is spent."""
        extra = self.blocks_needed(num_tokens) - self._charged.get(req_id, 0)
        if extra > self.num_free_blocks:
            return False
        if extra > 0:
            self._charged[req_id] = self._charged.get(req_id, 0) + extra
            self._num_charged += extra
        table = self.tables.setdefault(req_id, [])
        need = -(-_local(num_tokens, self.world_size, self.rank, self.interleave) // self.block_size) - len(table)
        if need > 0:
            got = self.allocator.allocate(need)
            if got is None:  # cannot happen: this rank never holds more than it was charged for
                raise RuntimeError(f"DCP rank {self.rank}: out of local blocks within the charged budget")
            table.extend(got)
        return True

    def free(self, req_id: str) -> None:
        super().free(req_id)
        self._num_charged -= self._charged.pop(req_id, 0)

    def slot(self, req_id: str, position: int) -> int:
        """This rank's cache slot of ``req_id``'s token at global ``position``, -1 when another rank owns it."""
        W, I = self.world_size, self.interleave
        if (position // I) % W != self.rank:
            return -1
        return super().slot(req_id, position // (I * W) * I + position % I)


class DCPMLAAttention(MLAAttention):
    """:class:`MLAAttention` whose cache reads go through DCP (set ``dcp_group``, ``dcp_interleave``)."""

    dcp_group = None
    dcp_interleave: int = 1

    def _forward_decode(self, q_nope, q_pe, kv_cache, md: MLADecodeMetadata, causal: bool) -> torch.Tensor:
        W_UK, W_UV = self._absorbed()
        ql_nope = torch.bmm(q_nope.transpose(0, 1), W_UK)  # [H, Td, L]
        q_mqa = torch.cat([ql_nope.transpose(0, 1), q_pe], dim=-1)  # [Td, H, L + R]
        o_lat, _ = dcp_mla_decode(
            q_mqa, kv_cache, md.block_table, md.seq_lens, md.query_start_loc, self.sm_scale, group=self.dcp_group,
            interleave=self.dcp_interleave, causal=causal, kv_cache_dtype=self.kv_cache_dtype,
            kv_scale=self.kv_scale if self.kv_cache_dtype == "fp8" else None, gather_heads=False,
            max_query_len=md.max_query_len, d_v=self.kv_lora_rank, validate=False,
        )  # fmt: skip
        return torch.bmm(o_lat.transpose(0, 1), W_UV).transpose(0, 1)  # [Td, H, V]

    def _forward_prefill(self, q_nope, q_pe, kv_c, k_pe, kv_cache, md: MLAPrefillMetadata, causal: bool):
        ctx = md.chunked_context
        if ctx is None:  # new tokens only: no cache read, the same on every rank
            return super()._forward_prefill(q_nope, q_pe, kv_c, k_pe, kv_cache, md, causal)
        if not causal:
            raise ValueError("a non-causal prefill with cached context is not supported")
        Tp, H, P = q_nope.shape
        q = torch.cat([q_nope, q_pe], dim=-1)
        kv = self.kv_b_proj(kv_c).view(Tp, H, P + self.v_head_dim)
        out, _ = dcp_mla_prefill_with_context(
            q, kv[..., :P], k_pe, kv[..., P:], kv_cache, md.block_table, ctx.context_lens, md.query_start_loc,
            self.kv_b_proj.weight.detach(), self.sm_scale, chunk_size=ctx.chunk_size, group=self.dcp_group,
            interleave=self.dcp_interleave, kv_cache_dtype=self.kv_cache_dtype,
            kv_scale=self.kv_scale if self.kv_cache_dtype == "fp8" else None, context_lens_cpu=ctx.context_lens_cpu,
            query_start_loc_cpu=md.query_start_loc_cpu, validate=False,
        )  # fmt: skip
        return out


def enable_dcp(model, group=None, interleave: int = 1):
    """Route every attention layer of ``model`` (a DeepSeek V3 of ``openmla.engine``) through DCP, in place.

    The layers keep their weights; their class becomes :class:`DCPMLAAttention` (a subclass that only
    overrides the two cache-reading paths). Returns ``model``.
    """
    check_dcp_args(group_info(group)[0], None, interleave)
    for attn in model.attention_layers:
        if type(attn) not in (MLAAttention, DCPMLAAttention):  # exact: V3.2's SparseMLAAttention subclasses it
            raise TypeError(f"DCP supports the V3 MLA layers only; got {type(attn).__name__}")
        attn.__class__ = DCPMLAAttention
        attn.dcp_group, attn.dcp_interleave = group, interleave
    return model


def dcp_engine(model, config=None, *, group=None, interleave: int = 1, **kwargs):
    r"""An :class:`~openmla.engine.LLMEngine` whose KV cache is sharded over ``group`` (every rank calls it).

    Args:
        model: a DeepSeek V3 of ``openmla.engine`` (the same weights on every rank).
        config (EngineConfig | None): the engine limits; ``num_blocks`` is per rank (default: room for
            ``max_num_seqs`` sequences of ``max_model_len`` tokens, the busiest rank's share). CUDA graphs are off.
        group: the DCP process group (None: the default group). interleave (int): ``I`` >= 1.
        **kwargs: passed to ``LLMEngine`` (device, dtype, drafter).

    Returns:
        LLMEngine: generates the same tokens on every rank, equal to a single-rank engine's.
    """
    from dataclasses import replace

    from openmla.engine.generate import EngineConfig, LLMEngine

    W, rank, _ = group_info(group)
    cfg = replace(config or EngineConfig(), cuda_graphs=False)
    if cfg.num_blocks is None:  # room for max_num_seqs sequences of max_model_len, this rank's share only
        max_len = cfg.max_model_len or model.config.max_position_embeddings
        cfg.num_blocks = cfg.max_num_seqs * -(-_local(max_len, W, 0, interleave) // cfg.block_size)
    enable_dcp(model, group, interleave)

    def block_manager(num_blocks: int, block_size: int) -> DCPBlockManager:
        return DCPBlockManager(num_blocks, block_size, W, rank, interleave)

    return LLMEngine(model, cfg, block_manager_factory=block_manager, **kwargs)
