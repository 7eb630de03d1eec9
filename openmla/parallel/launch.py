"""Start DCP ranks for a command: ``N`` local processes, or the processes ``torchrun`` already started.

``run_ranks(fn, args, nprocs)`` calls ``fn(args)`` on every rank with the default process group initialised:
gloo on CPU, NCCL on GPUs (rank ``r`` on ``cuda:r``, or ``LOCAL_RANK`` under torchrun). Under
``torchrun --nproc-per-node N`` (``RANK`` and ``WORLD_SIZE`` set) it runs this process's rank only; otherwise
it spawns ``nprocs`` processes (``torch.multiprocessing``) that meet over a local TCP port.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["run_ranks", "under_torchrun"]


def under_torchrun() -> bool:
    """True when this process was started by torchrun (or another launcher that sets RANK / WORLD_SIZE)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _backend(device: str | None) -> str:
    return "nccl" if device != "cpu" and torch.cuda.is_available() else "gloo"


def _rank_main(rank: int, world_size: int, local_rank: int, init_method: str | None, fn, args) -> int:
    backend = _backend(getattr(args, "device", None))
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    else:  # N processes share the CPU
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)
    try:
        return fn(args)
    finally:
        dist.destroy_process_group()


def _spawned(rank: int, world_size: int, port: int, fn, args) -> None:
    rc = _rank_main(rank, world_size, rank, f"tcp://127.0.0.1:{port}", fn, args)
    if rc:
        sys.exit(rc)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(fn: Callable, args, nprocs: int | None) -> int:
    r"""Run ``fn(args)`` (a picklable module-level function) on every DCP rank; returns rank 0's exit code.

    Args:
        fn (callable): ``fn(args) -> int``, called with the default process group initialised.
        args: passed to ``fn`` (pickled to spawned processes).
        nprocs (int | None): ranks to spawn; under torchrun it must be None or torchrun's world size.

    Raises:
        ValueError: ``nprocs`` < 1, more NCCL ranks than GPUs, or a torchrun world of another size.
        RuntimeError: a rank failed (its error message included).
    """
    if under_torchrun():
        W = int(os.environ["WORLD_SIZE"])
        if nprocs is not None and nprocs != W:
            raise ValueError(f"--dcp {nprocs} but torchrun started {W} processes")
        return _rank_main(int(os.environ["RANK"]), W, int(os.environ.get("LOCAL_RANK", 0)), "env://", fn, args)
    if not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"the number of DCP ranks must be a positive int; got {nprocs!r}")
    if _backend(getattr(args, "device", None)) == "nccl" and nprocs > torch.cuda.device_count():
        raise ValueError(f"--dcp {nprocs} needs {nprocs} GPUs (one per rank); {torch.cuda.device_count()} visible")
    try:
        mp.spawn(_spawned, args=(nprocs, _free_port(), fn, args), nprocs=nprocs, join=True)
    except mp.ProcessExitedException as err:
        return err.exit_code or 1
    except mp.ProcessRaisedException as err:
        last = str(err).strip().splitlines()[-1]
        if last.startswith(("ValueError:", "FileNotFoundError:")):  # bad input: the caller's usual error
            raise ValueError(last.split(":", 1)[1].strip()) from None
        raise RuntimeError(f"a DCP rank failed:\n{err}") from None
    return 0
