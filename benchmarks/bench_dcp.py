"""DCP decode benchmark: ``dcp_mla_decode`` (each route and merge) beside ``mla_decode`` over the same local shard.

python benchmarks/bench_dcp.py                                   # one process: W = 1 (NCCL on a GPU, gloo on CPU)
torchrun --nproc-per-node 8 benchmarks/bench_dcp.py              # W = 8 (one GPU per rank)
python benchmarks/bench_dcp.py --shapes "h16 b128 s8192 q1;h16 b32 s8192 q4" --csv out/dcp.csv
torchrun --nproc-per-node 2 benchmarks/bench_dcp.py --shapes "H128 b32 s131072 q1"  # 128 heads over the ranks

A shape is ``h<heads per rank> b<batch> s<global seq len> q<qlen>`` (optionally ``i<interleave>``), or with
``H<heads>`` the model's heads, ``H / W`` a rank (a TP x DCP layout: the ranks gather every head). Every rank holds a
random shard of ``dcp_local_seq_lens(s)`` keys per request in a bf16 cache of 64-token blocks. Rows: provider
(``local``: ``mla_decode`` of the gathered heads over the shard, no communication; ``comm-gather``: the heads'
all-gather of q alone; ``comm-<merge>``: the LSE merge alone (``merge_heads`` of the local result);
``dcp-<route>-<merge>``: the whole call), median / 20% / 80% ms (a CUDA-graph replay where the call captures, else
``do_bench``: column ``timer``), the bytes each rank receives on the reduce-scatter route and its KV cache bytes
(docs/dcp.md). Rank 0 prints a line a shape: the KV a rank holds, the attention's time and the communication's.
On CPU (the Triton interpreter) it runs one tiny default shape, as a smoke test.
"""

from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys

import torch
import torch.distributed as dist

import openmla  # noqa: F401  (configures the interpreter on CPU)
from openmla.ops.decode import mla_decode
from openmla.ops.plan import plan_decode
from openmla.parallel import dcp_local_seq_lens, dcp_mla_decode
from openmla.parallel.comm import all_gather_heads, merge_heads


def _parse(spec: str, W: int) -> dict:
    """``"h16 b128 s8192 q1"`` (or ``H<heads over the ranks>``) -> {h (a rank's heads), b, s, q, i}."""
    out = {"i": 1}
    for tok in spec.split():
        if tok[:1] not in ("h", "H", "b", "s", "q", "i") or not tok[1:].isdigit():
            raise ValueError(f"bad DCP shape {spec!r}: tokens are h<heads a rank> | H<heads>, b, s, q, i<n>")
        out[tok[0]] = int(tok[1:])
    if "H" in out:
        if "h" in out or out["H"] % W:
            raise ValueError(f"bad DCP shape {spec!r}: H{out['H']} must be a multiple of W = {W}, without h")
        out["h"] = out.pop("H") // W
    missing = [k for k in "hbsq" if k not in out]
    if missing:
        raise ValueError(f"bad DCP shape {spec!r}: missing {', '.join(missing)}")
    return out


def _time(fn, device) -> tuple[float, float, float, str]:
    """(median, p20, p80 ms, timer): on a GPU as a CUDA-graph replay where the call captures (the collectives
    included; host work then drops out, as in an engine's decode step), else ``do_bench`` (host work included)."""
    if device.type == "cuda":
        import triton.testing

        try:
            dist.barrier()
            return (*triton.testing.do_bench_cudagraph(fn, quantiles=[0.5, 0.2, 0.8]), "cudagraph")
        except Exception as exc:  # a call that does not capture: time it eagerly, say so in the row
            print(f"# CUDA graph capture failed ({type(exc).__name__}: {str(exc)[:80]}); do_bench", flush=True)
            torch.cuda.synchronize()
            dist.barrier()
            return (*triton.testing.do_bench(fn, quantiles=[0.5, 0.2, 0.8]), "do_bench")
    import time

    fn()
    ts = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e3)
    ts.sort()
    return ts[1], ts[0], ts[2], "perf_counter"


def _comm_bytes(W: int, T: int, H: int) -> int:
    """Bytes each rank receives per call on the reduce-scatter route (docs/dcp.md)."""
    return (W - 1) * T * H * (576 * 2 + W * 4 + 512 * 2)


def _bench_shape(spec: str, rank: int, W: int, device: torch.device, info: dict) -> list[dict]:
    """Time the local decode and every (route, merge) of one shape; one row each."""
    cuda = device.type == "cuda"
    s = _parse(spec, W)
    H, B, S, qlen, I = s["h"], s["b"], s["s"], s["q"], s["i"]
    page = 64 if cuda else 16
    g = torch.Generator(device=device).manual_seed(rank)
    seq = torch.full((B,), S, dtype=torch.int32, device=device)
    local = int(dcp_local_seq_lens(seq, W, rank, I)[0])
    nb = -(-local // page)
    dtype = torch.bfloat16 if cuda else torch.float32
    cache = torch.randn(B * nb + 1, page, 576, generator=g, device=device).to(dtype)
    bt = torch.arange(B * nb, dtype=torch.int32, device=device).view(B, nb)
    qsl = torch.arange(B + 1, dtype=torch.int32, device=device) * qlen
    q = (torch.randn(B * qlen, H, 576, generator=g, device=device) * 0.1).to(dtype)
    sm = 576**-0.5
    q_all = all_gather_heads(q)
    local_lens = torch.full((B,), local, dtype=torch.int32, device=device)
    plan = plan_decode(local_lens, qsl, q_all.shape[1], max_query_len=qlen, max_seq_len=local)  # (outside a capture)
    runs = [("local", lambda: mla_decode(q_all, cache, bt, local_lens, qsl, sm, causal=False, plan=plan,
                                         validate=False))]  # fmt: skip
    out_l, lse_l = runs[0][1]()  # the local result the merges alone take
    runs.append(("comm-gather", lambda: all_gather_heads(q)))
    for merge in ("reduce_scatter", "all_to_all"):
        runs.append((f"comm-{merge}", lambda merge=merge: merge_heads(out_l, lse_l, merge=merge)))
    for route in ["plain"] if qlen == 1 else ["segmented", "masked"]:
        for merge in ("reduce_scatter", "all_to_all"):
            kw = dict(interleave=I, route=route, merge=merge, max_query_len=qlen, max_seq_len=S, validate=False)
            runs.append((f"dcp-{route}-{merge}", lambda kw=kw: dcp_mla_decode(q, cache, bt, seq, qsl, sm, **kw)))
    rows, times = [], {}
    kv_bytes = B * local * 576 * cache.element_size()
    for name, fn in runs:
        dist.barrier()
        p50, p20, p80, timer = _time(fn, device)
        rows.append(dict(
            op="dcp_mla_decode", provider=name, shape=spec, world_size=W, p50_ms=round(p50, 4), p20_ms=round(p20, 4),
            p80_ms=round(p80, 4), timer=timer, comm_bytes=_comm_bytes(W, B * qlen, H), kv_bytes=kv_bytes, **info,
        ))  # fmt: skip
        times[name] = p50
        if rank == 0:
            print(f"{spec:24s} W{W} {name:28s} {p50:9.4f} ms  (p20 {p20:.4f}, p80 {p80:.4f}; {timer})", flush=True)
    if rank == 0:
        comm = ", ".join(f"gather + {m} {times['comm-gather'] + times[f'comm-{m}']:.4f} ms"
                         for m in ("reduce_scatter", "all_to_all"))  # fmt: skip
        print(
            f"{spec:24s} W{W} KV a rank {kv_bytes / 2**20:.1f} MiB ({W * H} heads, {local} of {S} keys a request); "
            f"attention {times['local']:.4f} ms; communication {comm}",
            flush=True,
        )
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=None, help='";"-separated, e.g. "h16 b128 s8192 q1"')
    p.add_argument("--csv", default=None, help="append one row per point to this CSV file")
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    if "RANK" not in os.environ:  # a single process: W = 1
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, W = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    default = "h16 b128 s8192 q1;h16 b32 s8192 q1;h16 b32 s8192 q2;h16 b32 s8192 q4;h128 b32 s4096 q1"
    shapes = (args.shapes or (default if cuda else "h2 b2 s40 q2")).split(";")
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    gpu = torch.cuda.get_device_name(device) if cuda else "cpu"
    rows = []
    for spec in shapes:
        rows += _bench_shape(spec, rank, W, device, dict(gpu=gpu, torch=torch.__version__, sha=sha))
    if args.csv and rank == 0:
        new = not os.path.exists(args.csv)
        with open(args.csv, "a", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            if new:
                w.writeheader()
            w.writerows(rows)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
