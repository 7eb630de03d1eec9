"""Issue 28 defects 1, 5 and 6 for the metadata layer: BatchSpec / MLAMetadataBuilder refuse what decode
would get wrong. Every test here failed on main at 64c94cf."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from openmla.metadata import BatchSpec, MLAMetadataBuilder


def _spec(qsl, seq_lens, device, *, max_seq_len=None, width=4, with_cpu_seq=True):
    B = len(seq_lens)
    qsl_t = torch.tensor(qsl, dtype=torch.int32)
    n = qsl[-1]
    return BatchSpec(
        query_start_loc=qsl_t.to(device),
        query_start_loc_cpu=qsl_t,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_table=torch.arange(B * width, dtype=torch.int32, device=device).view(B, width),
        slot_mapping=torch.full((n,), -1, dtype=torch.int64, device=device),
        num_reqs=B,
        num_actual_tokens=n,
        max_query_len=max(b - a for a, b in zip(qsl, qsl[1:])),
        max_seq_len=max(seq_lens) if max_seq_len is None else max_seq_len,
        seq_lens_cpu=torch.tensor(seq_lens, dtype=torch.int32) if with_cpu_seq else None,
    )


def _builder(device, **kw):
    args = dict(num_heads=4, block_size=4, max_num_seqs=4, max_model_len=16, max_num_batched_tokens=32,
                device=device, decode_threshold=3, dtype=torch.float32)  # fmt: skip
    return MLAMetadataBuilder(**{**args, **kw})


def test_batch_spec_refuses_decreasing_query_start_loc(device):
    with pytest.raises(ValueError, match="query_start_loc must not decrease"):
        _spec([0, 3, 2, 4], [5, 6, 7], device)


@pytest.mark.parametrize("with_cpu_seq", [True, False])
def test_builder_refuses_seq_len_beyond_max_model_len(with_cpu_seq, device):
    b = _builder(device)
    with pytest.raises(ValueError, match="max_model_len 16"):
        b.build(_spec([0, 1, 2], [5, 17], device, with_cpu_seq=with_cpu_seq))
    b.build(_spec([0, 1, 2], [5, 16], device, with_cpu_seq=with_cpu_seq))  # the limit itself is fine


def test_batch_spec_refuses_max_seq_len_below_seq_lens(device):
    with pytest.raises(ValueError, match="max_seq_len 6 is below"):
        _spec([0, 1, 2], [5, 9], device, max_seq_len=6)


def test_builder_refuses_unknown_cache_dtype(device):
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        _builder(device, kv_cache_dtype="fp16")


def test_builder_plans_for_the_latent_width(device):
    """Defect 1: the decode plan is sized for kv_lora_rank, not a fixed 512."""
    b = _builder(device, kv_entry=256 + 64, kv_lora_rank=256)
    md = b.build(_spec([0, 1, 2], [5, 9], device))
    assert md.decode.plan.d_v == 256 and md.decode.plan.o_part.shape[-1] == 256
    with pytest.raises(ValueError, match="kv_lora_rank"):
        _builder(device, kv_entry=64, kv_lora_rank=64)


def test_batch_spec_refuses_understated_max_query_len(device):
    """max_query_len sizes the decode plan: a value below the longest query (from query_start_loc_cpu) is refused,
    an upper bound is fine; seq_lens_cpu must be an integer tensor."""
    spec = _spec([0, 2, 5], [4, 6], device)
    with pytest.raises(ValueError, match=r"max_query_len must be an int >= the longest query \(3\)"):
        dataclasses.replace(spec, max_query_len=2)
    dataclasses.replace(spec, max_query_len=8)
    with pytest.raises(TypeError, match="seq_lens_cpu must be an integer tensor"):
        dataclasses.replace(spec, seq_lens_cpu=torch.tensor([4.0, 6.0]))
