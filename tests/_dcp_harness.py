"""Multi-process harness of the DCP tests: ``W`` spawned ranks over a file store; a rank's traceback on failure."""

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
