"""Decode context parallelism (DCP) on plain ``torch.distributed`` (gloo on CPU, NCCL on GPUs).

The KV cache of every request is sharded over the ``W`` ranks of a process group: global position ``g``
lives on rank ``(g // I) % W`` (interleave ``I``). Public API:

* sharding: :func:`dcp_local_seq_lens`, :func:`dcp_local_verify_row_lens`, :func:`dcp_slot_mapping`
  (and the position maps :func:`dcp_owner`, :func:`dcp_local_position`, :func:`dcp_global_position`);
* :func:`dcp_mla_decode`: decode and causal verify over the sharded cache, merged exactly by LSE;
* :func:`dcp_mla_prefill_with_context`: chunked-context prefill with the context gathered from every shard;
* :func:`select_dcp_decode_route`, :func:`dcp_masked_decode`: the verify routes (SPEC §5.6).

Communication per step and the collectives each backend runs: ``docs/dcp.md``.
"""

from openmla.parallel.dcp import dcp_mla_decode
from openmla.parallel.prefill import dcp_mla_prefill_with_context
from openmla.parallel.sharding import (
    dcp_global_position,
    dcp_local_position,
    dcp_local_seq_lens,
    dcp_local_verify_row_lens,
    dcp_owner,
    dcp_slot_mapping,
)
from openmla.parallel.verify import dcp_masked_decode, select_dcp_decode_route

__all__ = [
    "dcp_mla_decode",
    "dcp_mla_prefill_with_context",
    "dcp_local_seq_lens",
    "dcp_local_verify_row_lens",
    "dcp_slot_mapping",
    "dcp_owner",
    "dcp_local_position",
    "dcp_global_position",
    "dcp_masked_decode",
    "select_dcp_decode_route",
]
