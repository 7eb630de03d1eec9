"""Shared pieces of the DCP tests: the multi-process harness (``W`` spawned ranks over a file store; a rank's
traceback on failure, a stuck rank's stack) and the random global batch every rank and the single-process tests
shard."""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank, W, init, backend, err_file, fn, args):
    with open(f"{err_file}.{rank}.stack", "w") as stack:
        faulthandler.register(signal.SIGUSR1, file=stack, all_threads=True)  # run_ranks asks a stuck rank where
        try:
            torch.set_num_threads(1)
            dev = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
            if backend == "nccl":  # before the process group, which binds the rank to the current device
                torch.cuda.set_device(dev)
            dist.init_process_group(backend, init_method=init, rank=rank, world_size=W)
            try:
                fn(rank, W, dev, *args)
                dist.barrier(**({"device_ids": [rank]} if backend == "nccl" else {}))
            finally:  # also after a failure: an NCCL group left alive can hang the process's exit
                dist.destroy_process_group()
        except BaseException:
            with open(f"{err_file}.{rank}", "w") as f:
                f.write(traceback.format_exc())
            raise


def _end_ranks(ctx, err) -> list[str]:
    """Dump the Python stacks of the ranks still running (faulthandler, SIGUSR1), end them, return the stacks."""
    alive = [(r, p) for r, p in enumerate(ctx.processes) if p.is_alive()]
    for _, p in alive:
        os.kill(p.pid, signal.SIGUSR1)
    time.sleep(1.0 if alive else 0.0)
    stacks = []
    for r, p in alive:
        dump = open(f"{err}.{r}.stack").read() if os.path.exists(f"{err}.{r}.stack") else "(not started)"
        stacks.append(f"rank {r} was still running:\n{dump}")
        p.kill()
        p.join(10)
    return stacks


# NVLink multicast (NVLS) stays off in every NCCL rank the tests start (the lent multi-GPU machines ask for it)
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def gpus_for(W: int) -> bool:
    """Whether this machine has a CUDA GPU for each of ``W`` ranks."""
    return torch.cuda.is_available() and torch.cuda.device_count() >= W


def run_ranks(fn, W, tmp_path, *args, backend="gloo", timeout=900.0):
    """Spawn ``W`` processes running ``fn(rank, W, device, *args)``; raise with the failing ranks' tracebacks.

    Ranks still running after ``timeout`` seconds, or when the test is interrupted (pytest-timeout, Ctrl-C), are
    ended; their Python stacks go into the error (or to stderr, which pytest keeps in the report). NCCL ranks get
    :data:`NCCL_ENV` unless the environment sets those variables already.
    """
    if backend == "nccl":
        for k, v in NCCL_ENV.items():
            os.environ.setdefault(k, v)
    init = f"file://{tmp_path}/dist_store"
    err = str(tmp_path / "err")
    ctx = mp.spawn(_entry, args=(W, init, backend, err, fn, args), nprocs=W, join=False)
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(max(deadline - time.monotonic(), 0.0)):
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{W} {backend} ranks still running after {timeout:.0f} s")
    except BaseException as exc:
        stacks = _end_ranks(ctx, err)
        if not isinstance(exc, Exception):
            sys.stderr.write("\n".join(stacks))
            raise
        msgs = [open(f"{err}.{r}").read() for r in range(W) if os.path.exists(f"{err}.{r}")] + stacks
        if isinstance(exc, TimeoutError) or not msgs:
            msgs.insert(0, str(exc))
        raise AssertionError("\n".join(msgs)) from None


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
