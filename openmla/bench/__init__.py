"""``openmla bench``: sweeps of the ops over DeepSeek shapes, peers side by side, CSV / JSON / PNG output.

Run it as ``openmla bench`` or ``python -m openmla.bench`` (the same options; the second form also works in a
checkout whose ``cli.py`` predates this subpackage). It uses only the public ``openmla`` API and
``openmla.utils.perf``, so this folder can be copied into an older checkout for a before/after run.

Every run first measures its yardsticks: the read bandwidth (``torch.sum`` over bf16 buffers of 0.5-4 GiB, the
best) and the bf16 matmul peak (square ``torch.matmul`` of 4096-16384, the best); each row states its GB/s and
TFLOPS as fractions of them, so that figures of one run compare with each other and not across boards. A family
that reads cache rows at random slots names their sizes in ``GATHER_ROW_BYTES`` (optional); the run then also
measures the gather rate of such rows (a Triton kernel reading whole rows at random slots of a 1 GiB pool, the best
of a few tilings), and ``ctx.rows(..., gather_bytes=n)`` fills the column ``frac_gather`` (GB/s over that rate).

Op families (the registry below, one module each) plug in through four names::

    OP: str                         # the op's name in the table header and in error rows
    PRESETS: dict[str, list[str]]   # preset -> shape specs; "default", "quick" (GPU) and "tiny" (CPU) at least
    def parse(spec: str) -> Shape   # a spec string -> a shape object (ValueError if bad); str(shape) labels rows,
                                    # its ``dtype`` attribute (if any) error rows
    def run(shape, ctx: BenchContext) -> list[dict]   # time one point, return ctx.rows(...) (one row a provider)

Inside ``run`` a family builds its inputs on ``ctx.device``, calls openmla once outside the timed region (errors
surface here), adds peers found through ``ctx.peer("module")`` (None when missing or ``--no-peers``: the column
stays empty), times ``ctx.time({"openmla": fn, "peer": fn2}, graph=...)`` (alternating rounds; CUDA-graph replay
for launch-bound ops, ``do_bench`` otherwise) and returns ``ctx.rows(op, str(shape), timings, flops=..., nbytes=...,
dtype=..., peer="peer", check=cosine)`` (``ratio`` = peer p50 / openmla p50; several ``ctx.rows`` lists may be
joined when a point has several parts). With ``--against``, ``ctx.baseline`` is an older openmla package: time its
op as provider ``"before"`` in the same ``ctx.time`` call (``speedup`` = before / openmla). An exception from ``run``
becomes an error row; the sweep goes on. Without
``--family`` every registered family runs that imports and has the preset: import the openmla names a family needs at
the top of its module (``from openmla import sparse_mla``), so that an older checkout without them skips the family
instead of failing each point. To add a family, write
``openmla/bench/<name>.py`` and add it to ``FAMILIES``; ``tests/test_bench.py`` runs its ``tiny`` preset end to end.
"""

from __future__ import annotations

import importlib

# family name -> module (imported when selected)
FAMILIES: dict[str, str] = {
    "decode": "openmla.bench.decode",
    "prefill": "openmla.bench.prefill",
    "sparse": "openmla.bench.sparse",
    "indexer": "openmla.bench.indexer",
    "v4": "openmla.bench.v4",
    "sparse_v4": "openmla.bench.sparse_v4",
    "v4_layer": "openmla.bench.v4_layer",
}

__all__ = ["FAMILIES", "load_family", "main"]


def load_family(name: str):
    """The module of family ``name`` (ValueError for an unknown name)."""
    if name not in FAMILIES:
        raise ValueError(f"unknown bench family {name!r}; known: {', '.join(FAMILIES)}")
    return importlib.import_module(FAMILIES[name])


def main(argv: list[str] | None = None) -> int:
    """``python -m openmla.bench [options]``: the same as ``openmla bench [options]``; returns the exit code."""
    from openmla.bench.cli import main as _main

    return _main(argv)
