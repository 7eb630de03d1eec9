"""Shared pieces of the DCP tests: the multi-process harness (``W`` spawned ranks over a file store; a rank's
traceback on failure) and the random global batch every rank and the single-process tests shard."""

from __future__ import annotations

import os
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank, W, init, backend, err_file, fn, args):
    try:
        torch.set_num_threads(1)
        dist.init_process_group(backend, init_method=init, rank=rank, world_size=W)
        dev = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
        if backend == "nccl":
            torch.cuda.set_device(dev)
        fn(rank, W, dev, *args)
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        with open(f"{err_file}.{rank}", "w") as f:
            f.write(traceback.format_exc())
        raise


def run_ranks(fn, W, tmp_path, *args, backend="gloo"):
    """Spawn ``W`` processes running ``fn(rank, W, device, *args)``; raise with the failing ranks' tracebacks."""
    init = f"file://{tmp_path}/dist_store"
    err = str(tmp_path / "err")
    try:
        mp.spawn(_entry, args=(W, init, backend, err, fn, args), nprocs=W, join=True)
    except Exception as exc:
        msgs = [open(f"{err}.{r}").read() for r in range(W) if os.path.exists(f"{err}.{r}")]
        raise AssertionError("\n".join(msgs) or str(exc)) from None


def global_batch(seq, qlens, heads, dtype, seed=0, *, block_size):
    """A random global paged cache (shuffled blocks) and q ([T, heads, 576]) on the CPU.

    Returns:
        ``(q, cache [num_blocks, block_size, 576], block_table [B, max_blocks] int32, seq_lens [B] int32,
        query_start_loc [B + 1] int32)``.
    """
    g = torch.Generator().manual_seed(seed)
    B = len(seq)
    nb = [-(-s // block_size) for s in seq]
    total = sum(nb) + 1
    cache = (torch.randn(total, block_size, 576, generator=g) * 0.5).to(dtype)
    perm = torch.randperm(total, generator=g)
    bt = torch.zeros(B, max(nb + [1]), dtype=torch.int32)
    k = 0
    for b in range(B):
        for j in range(nb[b]):
            bt[b, j] = perm[k]
            k += 1
    qsl = torch.tensor([0] + torch.cumsum(torch.tensor(qlens), 0).tolist(), dtype=torch.int32)
    q = (torch.randn(int(qsl[-1]), heads, 576, generator=g) * 0.3).to(dtype)
    return q, cache, bt, torch.tensor(seq, dtype=torch.int32), qsl
