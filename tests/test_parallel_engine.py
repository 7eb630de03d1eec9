"""The engine under DCP: the same tokens as one rank for N = 1, 2, 3, with chunked prefill over a sharded
context and speculative verify; each rank allocates only the blocks of the tokens it owns."""

from __future__ import annotations

import json

import pytest
import torch
from _dcp_harness import NCCL_ENV, gpus_for, run_ranks

from openmla.cli import main
from openmla.engine import EngineConfig, LLMEngine, load_model
from openmla.parallel.engine import DCPBlockManager, dcp_engine
from openmla.utils.testing import on_gpu

PROMPTS = [
    [7, 3, 9, 27, 101, 4, 8, 15, 16, 23, 42, 99, 12, 5, 77, 31, 64, 2, 90, 11],
    [5, 6],
    [40, 41, 42, 40, 41, 42, 40],  # repetitive: the n-gram drafter proposes from it
]
NEW = 5
# a 12-token step budget cuts the 20-token prompt into chunks (prefill over cached context); 2 drafts per verify
CFG = dict(block_size=4, max_num_seqs=3, max_num_batched_tokens=12, max_model_len=64, num_spec_tokens=2)


def _single_rank():
    model, _ = load_model("tiny", seed=0, device="cuda" if on_gpu() else "cpu")  # the ranks' kind of device
    eng = LLMEngine(model, EngineConfig(**CFG))
    return eng.generate(PROMPTS, NEW), eng.stats.num_steps, eng.stats.num_draft_tokens


def _engine_rank(rank, W, dev, interleave, want):
    model, _ = load_model("tiny", seed=0, device=dev)
    eng = dcp_engine(model, EngineConfig(**CFG), interleave=interleave)
    ids = [eng.add_request(p, NEW) for p in PROMPTS]
    eng.step()  # the first step prefills: each rank holds blocks for its own tokens only
    bm = eng.block_manager
    # the cache holds 3 sequences of the busiest rank's (rank 0's) share of max_model_len = 64 tokens
    share = sum(1 for g in range(64) if (g // interleave) % W == 0)
    assert eng.runner.kv_caches[0].shape[0] == 3 * -(-share // CFG["block_size"])
    computed = {req.req_id: req.num_computed_tokens for req in eng.scheduler.running}
    assert computed, "the first step scheduled nothing"
    for r in ids:
        n = computed.get(r, 0)
        owned = sum(1 for g in range(n) if (g // interleave) % W == rank)
        assert len(bm.table(r)) == -(-owned // CFG["block_size"]), (rank, r, n, bm.table(r))
    while eng.has_unfinished():
        eng.step()
    got = [eng.output_ids(r) for r in ids]
    assert (got, eng.stats.num_steps, eng.stats.num_draft_tokens) == want, (rank, got, eng.stats)


@pytest.fixture(scope="module")
def reference():
    return _single_rank()


def test_block_manager_charges_the_busiest_rank():
    bms = [DCPBlockManager(6, 4, 3, r, 2) for r in range(3)]
    for bm in bms:
        assert bm.blocks_needed(13) == 2  # rank 0 owns positions 0, 1, 6, 7, 12: two blocks of 4
        assert bm.ensure("a", 13) and bm.num_free_blocks == 4
        assert bm.ensure("b", 30) and bm.num_free_blocks == 1  # rank 0 owns 10 of 30: three blocks
        assert not bm.ensure("c", 13)  # the same answer on every rank, though ranks 1, 2 hold fewer blocks
        bm.free("b")
        assert bm.num_free_blocks == 4 and bm.ensure("c", 13)
    assert [len(bm.table("a")) for bm in bms] == [2, 1, 1]  # 5, 4, 4 tokens of 13
    assert [bm.slot("a", 7) for bm in bms[1:]] == [-1, -1] and bms[0].slot("a", 7) >= 0
    with pytest.raises(ValueError, match="rank"):
        DCPBlockManager(4, 4, 2, 2)


@pytest.mark.skipif(on_gpu(), reason="multi-process gloo on CPU")
def test_engine_tokens_dcp2(reference, tmp_path):
    run_ranks(_engine_rank, 2, tmp_path, 1, reference)


@pytest.mark.gpu
@pytest.mark.parametrize("W,interleave", [(2, 1), (4, 2)])
def test_engine_tokens_dcp_nccl(W, interleave, reference, tmp_path):
    if not on_gpu() or not gpus_for(W):
        pytest.skip(f"NCCL over {W} GPUs (this machine has {torch.cuda.device_count()})")
    run_ranks(_engine_rank, W, tmp_path, interleave, reference, backend="nccl")


def _cli_tokens(capfd, extra):
    argv = ["generate", "--prompt-ids", "7,3,9,27,101,4,8,15,16", "--prompt-ids", "40,41,42,40,41,42,40",
            "--max-new-tokens", "4", "--speculate", "2", "--block-size", "4", "--dtype", "float32", "--json",
            *extra]  # fmt: skip
    assert main(argv) == 0
    return json.loads(capfd.readouterr().out.strip().splitlines()[-1])


def test_cli_generate_dcp(capfd, monkeypatch):
    """``openmla generate --dcp N`` spawns N ranks: N = 3 (I = 2) on CPU; through NCCL on a GPU machine, one rank a
    GPU (up to 4)."""
    want = _cli_tokens(capfd, [])
    n = str(min(torch.cuda.device_count(), 4)) if on_gpu() else "3"
    for k, v in NCCL_ENV.items():
        monkeypatch.setenv(k, v)
    assert _cli_tokens(capfd, ["--dcp", n, "--dcp-interleave", "2"]) == want
    assert len(want) == 2 and all(len(o) == 4 for o in want)


def test_cli_generate_dcp_errors(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--prompt-ids", "5", "--max-new-tokens", "2", "--dcp", "0"])
    assert "--dcp" in capsys.readouterr().err
