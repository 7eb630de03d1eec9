"""``openmla bench`` end to end at tiny shapes (the interpreter on the CPU; peers off), its rows and its registry."""

from __future__ import annotations

import csv
import importlib.util
import json
import math
import os
import sys
import types

import pytest
import torch

from openmla import bench
from openmla.bench import decode, prefill, report
from openmla.bench.cli import main as bench_main
from openmla.bench.context import BenchContext, cosine
from openmla.bench.timing import Timer, Timing, format_kernels, kernel_summary
from openmla.cli import main
from openmla.utils.testing import suite_device

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FAST = ["--rep", "5", "--rounds", "1", "--no-peers"]
DEV = suite_device()  # the bench runs on cuda where there is one (tiny shapes there too)


def _csv(path):
    with open(path, newline="") as f:
        r = csv.DictReader(f)
        return r.fieldnames, list(r)


def test_kernel_summary():
    # per-call device time by short kernel name (template arguments and parameters dropped), longest first
    events = [("void sm90::fwd_kernel<T, 64>(Params)", 140.0), ("_reduce_kernel", 20.0),
              ("void sm90::fwd_kernel<T, 64>(Params)", 160.0), ("Memset (Device)", 2.0)]  # fmt: skip
    got = kernel_summary(events, 2)
    assert list(got.items()) == [("sm90::fwd_kernel", 150.0), ("_reduce_kernel", 10.0), ("Memset ", 1.0)]
    assert format_kernels(got) == "sm90::fwd_kernel 150.0; _reduce_kernel 10.0; Memset  1.0"
    assert kernel_summary([], 3) == {} and format_kernels({}) == ""


def test_bench_profile_column(tmp_path):
    # --profile N: each provider's kernels in the column "kernels" (a GPU only: empty under the interpreter)
    rc = main(["bench", "--family", "decode", "--shapes", "h2 b2 s70 q1", "--out", str(tmp_path), "--label", "p",
               "--profile", "2", *FAST])  # fmt: skip
    assert rc == 0
    cols, rows = _csv(tmp_path / "bench-p.csv")
    assert "kernels" in cols
    own = [r for r in rows if r["provider"] == "openmla"]
    assert len(own) == 1
    if DEV.type == "cuda":
        assert "_kernel" in own[0]["kernels"] and float(own[0]["kernels"].split("; ")[0].rsplit(" ", 1)[1]) > 0
    else:
        assert own[0]["kernels"] == ""
    assert json.loads((tmp_path / "bench-p.json").read_text())["meta"]["profile_calls"] == 2
    bad = ["--family", "decode", "--shapes", "h2 b2 s70 q1", "--out", str(tmp_path), "--profile", "-1", *FAST]
    assert bench_main(bad) == 2


def test_bench_end_to_end(tmp_path):
    rc = main(["bench", "--shapes", "tiny", "--out", str(tmp_path), "--label", "t 1", *FAST])
    assert rc == 0
    cols, rows = _csv(tmp_path / "bench-t_1.csv")
    assert cols == report.COLUMNS
    doc = json.loads((tmp_path / "bench-t_1.json").read_text())
    assert len(doc["rows"]) == len(rows) and doc["meta"]["label"] == "t 1" and doc["meta"]["bw_gbs"] > 0
    assert set(doc["rows"][0]) == set(report.COLUMNS)
    own = [r for r in rows if r["provider"] == "openmla"]
    fams = [r["family"] for r in own]
    assert list(dict.fromkeys(fams)) == list(bench.FAMILIES)  # every registered family, in order
    n_dec, n_pre = len(decode.PRESETS["tiny"]), len(prefill.PRESETS["tiny"])
    assert fams[: n_dec + n_pre] == ["decode"] * n_dec + ["prefill"] * n_pre
    assert {r["dtype"] for r in own if r["family"] in ("decode", "prefill")} == {"bf16", "fp8"}
    # the sparse families declare their rows' sizes: the run measures the random-row gather rate of each
    assert {r["op"] for r in rows if r["family"] == "roofline"} == {"read", "matmul", "gather584", "gather656"}
    assert sorted(doc["meta"]["gather_gbs"]) == ["584", "656"] and min(doc["meta"]["gather_gbs"].values()) > 0
    for r in own:  # frac_gather on the fp8 sparse decode points (their rows at random slots), empty elsewhere
        fp8_sparse_decode = "decode" in r["shape"] and r["family"].startswith("sparse") and r["dtype"] == "fp8"
        if fp8_sparse_decode:
            rb = 656 if r["family"] == "sparse" else 584
            want = float(r["gbs"]) / doc["meta"]["gather_gbs"][str(rb)]
            assert math.isclose(float(r["frac_gather"]), want, rel_tol=1e-6), r
        else:
            assert r["frac_gather"] == "", r
    for r in own:
        p50, p20, p80 = (float(r[k]) for k in ("p50_us", "p20_us", "p80_us"))
        assert 0 < p20 <= p50 <= p80, r
        assert math.isclose(float(r["gbs"]), float(r["bytes"]) / p50 / 1e3, rel_tol=1e-6)
        assert math.isclose(float(r["tflops"]), float(r["flops"]) / p50 / 1e6, rel_tol=1e-6)
        assert math.isclose(float(r["frac_bw"]), float(r["gbs"]) / float(r["bw_gbs"]), rel_tol=1e-6)
        assert math.isclose(float(r["frac_peak"]), float(r["tflops"]) / float(r["peak_tflops"]), rel_tol=1e-6)
        assert r["label"] == "t 1" and r["gpu"] and r["torch"] and r["triton"] and r["git"]
        assert not r["error"] and int(r["samples"]) == 2 or (DEV.type == "cuda" and int(r["samples"]) >= 1)
        assert r["timer"] == "cpu" if DEV.type == "cpu" else r["timer"] in ("cuda-graph", "do_bench")
        if r["family"] in ("decode", "prefill"):  # no FlashMLA / cuDNN with --no-peers: empty columns
            assert r["peer"] == "" and r["ratio"] == ""
    # h2 b2 s70 q1: 140 keys of 1152 bytes + q (2 x 2 x 576 x 2) + out (2 x 2 x 512 x 2); 2 * 2 * 140 * 1088 FLOP
    first = own[0]
    assert first["shape"] == "h2 b2 s70 q1" and float(first["bytes"]) == 140 * 1152 + 4 * 1152 + 4 * 1024
    assert float(first["flops"]) == 2 * 2 * 140 * 1088
    if importlib.util.find_spec("matplotlib") is not None:  # the bench extra is installed: the plots too
        assert (tmp_path / "bench-t_1-decode.png").stat().st_size > 0
        assert (tmp_path / "bench-t_1-prefill.png").stat().st_size > 0


def test_bench_without_extra(tmp_path, monkeypatch, capsys):
    """No rich, no matplotlib: plain progress lines and a message instead of the plots."""
    monkeypatch.setitem(sys.modules, "rich", None)
    monkeypatch.setitem(sys.modules, "rich.progress", None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    rc = bench_main(["--family", "decode", "--shapes", "h2 b1 s16 q1", "--out", str(tmp_path), *FAST])
    assert rc == 0
    out, err = capsys.readouterr()
    assert "[1/1" in err and "decode h2 b1 s16 q1" in err
    assert "plots skipped" in out and "h2 b1 s16 q1" in out
    assert (tmp_path / "bench.csv").exists() and not list(tmp_path.glob("*.png"))


def test_shape_specs():
    s = decode.parse("h128 b128 s8192 q2 fp8")
    assert (s.h, s.b, s.s, s.q, s.dtype) == (128, 128, 8192, 2, "fp8") and str(s) == "h128 b128 s8192 q2"
    ragged = decode.parse("h16 b128 s8192~4096")
    lens = ragged.lengths()
    assert len(lens) == 128 and min(lens) >= 1 and max(lens) <= 16384 and len(set(lens)) > 64
    assert lens == ragged.lengths()  # seeded: the same draw in every run
    uni = decode.parse("h128 b64 s512..16384").lengths()
    assert min(uni) >= 512 and max(uni) <= 16384
    p = prefill.parse("h128 n4096 fp8")
    assert (p.h, p.n, p.t, p.batch, p.dtype) == (128, 4096, 16384, 4, "fp8")
    for mod in (decode, prefill):
        for preset, specs in mod.PRESETS.items():
            assert [str(mod.parse(x)) for x in specs], preset
        with pytest.raises(ValueError):
            mod.parse("h0 b1 s1 n1")
        with pytest.raises(ValueError):
            mod.parse("x128")


def test_bad_arguments(tmp_path, capsys):
    assert bench_main(["--shapes", "nope", "--out", str(tmp_path)]) == 2
    assert bench_main(["--shapes", "h2", "--out", str(tmp_path)]) == 2  # no family takes it
    assert bench_main(["--shapes", "prefill:h2 b1 s16", "--out", str(tmp_path)]) == 2
    assert bench_main(["--family", "nope", "--out", str(tmp_path)]) == 2
    assert "error" in capsys.readouterr().err


def test_specs_find_their_family():
    from openmla.bench.cli import _plan

    args = types.SimpleNamespace(
        family="decode,prefill", shapes="h2 b1 s16 fp8; h2 n8 t16;decode:h1 b1 s1", quick=False
    )
    plan = _plan(args, torch.device("cpu"))
    assert [str(s) for s in plan["decode"]] == ["h2 b1 s16 q1", "h1 b1 s1 q1"] and plan["decode"][0].dtype == "fp8"
    assert [str(s) for s in plan["prefill"]] == ["h2 n8 t16"]
    # a colon inside a spec (a Gluon variant, "g:lazy") is the spec's own, with or without a family prefix
    specs = "v4decode h2 b2 q2 w8 k8 g:lazy; sparse_v4:v4decode h2 b2 q2 w8 k8 g:staged"
    v4 = types.SimpleNamespace(family="sparse_v4", quick=False, shapes=specs)
    assert [str(s).split()[-1] for s in _plan(v4, torch.device("cpu"))["sparse_v4"]] == ["g:lazy", "g:staged"]
    args.shapes = "quick"
    assert {k: len(v) for k, v in _plan(args, torch.device("cpu")).items()} == {
        k: len(bench.load_family(k).PRESETS["quick"]) for k in ("decode", "prefill")
    }


def test_rows_ratio_and_peer_dtype():
    ctx = BenchContext(torch.device("cpu"), Timer(torch.device("cpu")), peers=False, quick=False, bw_gbs=100.0,
                       peak_tflops=10.0, env=dict(gpu="g", torch="t", triton="tr", git="x", label="L"))  # fmt: skip
    ctx.family = "decode"
    t = {"openmla": Timing([10.0, 12.0, 11.0], "cpu"), "flashmla": Timing([22.0], "cpu")}
    own, peer = ctx.rows("mla_decode", "h1", t, flops=1e6, nbytes={"openmla": 1e3, "flashmla": 2e3},
                         dtype={"openmla": "fp8", "flashmla": "bf16"}, peer="flashmla", check=0.999)  # fmt: skip
    assert own["p50_us"] == 11.0 and own["ratio"] == 2.0 and own["peer"] == "flashmla" and own["check"] == 0.999
    assert own["gbs"] == 1e3 / 11.0 / 1e3 and own["frac_bw"] == own["gbs"] / 100.0 and own["label"] == "L"
    assert peer["dtype"] == "bf16" and peer["gbs"] == 2e3 / 22.0 / 1e3 and peer["ratio"] == ""
    failed = ctx.rows("mla_decode", "h1", {"openmla": Timing([5.0]), "flashmla": Timing(error="boom")}, flops=1.0,
                      nbytes=1.0, dtype="bf16", peer="flashmla")  # fmt: skip
    assert failed[0]["ratio"] == "" and failed[1]["error"] == "boom" and failed[1]["p50_us"] == ""
    assert "boom" in report.table_lines(failed)[0]


def test_gather_yardstick():
    """The gather yardstick's kernel reads every word of each selected row (its per-program XOR against torch's), and
    bad row sizes are refused."""
    from openmla.bench.timing import _gather_rows_kernel, gather_bandwidth

    g = torch.Generator().manual_seed(0)
    words, rows, n = 146, 16, 37  # 584-byte rows; the last program holds 5 rows
    pool = torch.randint(-(2**31), 2**31 - 1, (50 * words,), dtype=torch.int32, generator=g).to(DEV)
    slots = torch.randint(0, 50, (n,), dtype=torch.int32, generator=g).to(DEV)
    out = torch.empty(3, dtype=torch.int32, device=DEV)
    _gather_rows_kernel[(3,)](pool, slots, out, n, ROW_WORDS=words, BLOCK_W=256, ROWS=rows, num_warps=4)
    picked = pool.view(50, words)[slots.long()].cpu()
    for p in range(3):
        want = 0
        for w in picked[p * rows : (p + 1) * rows].flatten().tolist():
            want ^= w
        assert int(out[p]) == want
    gbs, sweep = gather_bandwidth(DEV, 584)
    assert gbs > 0 and gbs == max(v for _, v in sweep)
    with pytest.raises(ValueError, match="row_bytes"):
        gather_bandwidth(DEV, 582)


def test_registry_plugin(tmp_path, monkeypatch):
    """A family registered in FAMILIES runs through the same driver; a point that raises becomes an error row."""
    mod = types.ModuleType("fake_family")
    mod.OP = "fake_op"
    mod.PRESETS = {"tiny": ["ok", "bad"], "default": ["ok"], "quick": ["ok"]}
    mod.parse = lambda spec: spec

    def run(shape, ctx):
        if shape == "bad":
            raise RuntimeError("no kernel for this shape")
        x = torch.ones(64, device=ctx.device)
        t = ctx.time({"openmla": lambda: x.sum()}, graph=True)
        return ctx.rows(mod.OP, shape, t, flops=1e3, nbytes=1e3, dtype="bf16")

    mod.run = run
    monkeypatch.setitem(sys.modules, "fake_family", mod)
    monkeypatch.setitem(bench.FAMILIES, "fake", "fake_family")
    rc = bench_main(["--family", "fake", "--shapes", "tiny", "--out", str(tmp_path), "--no-plot", *FAST])
    assert rc == 1  # an openmla point failed
    _, rows = _csv(tmp_path / "bench.csv")
    fake = [r for r in rows if r["family"] == "fake"]
    assert [(r["shape"], bool(r["error"])) for r in fake] == [("ok", False), ("bad", True)]
    assert "no kernel" in fake[1]["error"] and float(fake[0]["p50_us"]) > 0


class _FakeFlashMLA:
    """FlashMLA's dense decode as its docstring states it (q `[b, s_q, h_q, 576]`, k_cache `[blocks, 64, 1, 576]`,
    causal bottom-right), in fp32 torch: checks that the bench hands the peer the same problem in its layout."""

    @staticmethod
    def get_mla_metadata(*args, **kwargs):
        return object(), None

    @staticmethod
    def flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v, meta, softmax_scale, causal):
        b, s_q, h, d = q.shape
        page = k_cache.shape[1]
        out = torch.zeros(b, s_q, h, head_dim_v, device=q.device)
        for i in range(b):
            n = int(cache_seqlens[i])
            kv = k_cache[block_table[i, : -(-n // page)].long()].reshape(-1, d)[:n].float()
            s = torch.einsum("qhd,kd->qhk", q[i].float(), kv) * softmax_scale
            if causal:
                pos = torch.arange(max(n, s_q), device=q.device)
                hide = pos[None, :n] > (n - s_q + pos[:s_q])[:, None]
                s = s.masked_fill(hide[:, None, :], float("-inf"))
            out[i] = torch.softmax(s, -1).nan_to_num(0.0) @ kv[:, :head_dim_v]  # a row that sees no key: 0
        return out.to(q.dtype), torch.zeros(b, h, s_q, device=q.device)


@pytest.mark.parametrize("spec", ["h4 b3 s50~30 q2", "h2 b2 s70 q1 fp8"])
def test_decode_peer_side_by_side(monkeypatch, spec):
    """With a peer present: its row, the ratio and the output check (the peer sees the same inputs)."""
    dev = DEV
    ctx = BenchContext(dev, Timer(dev, rep=5, rounds=1), peers=True, quick=False, bw_gbs=1.0, peak_tflops=1.0,
                       env=dict(gpu="cpu", torch="t", triton="tr", git="x", label=""))  # fmt: skip
    ctx.family = "decode"
    monkeypatch.setattr(ctx, "peer", lambda name: _FakeFlashMLA if name == "flash_mla" else None)
    # the stand-in syncs (it reads the lengths): no CUDA graph for it on a GPU
    monkeypatch.setattr(ctx, "time", lambda fns, graph=True: ctx.timer.alternate(fns, graph=False))
    own, peer = decode.run(decode.parse(spec), ctx)
    assert (own["provider"], peer["provider"], own["peer"]) == ("openmla", "flashmla", "flashmla")
    assert own["check"] > (0.99 if "fp8" in spec else 0.9999), own["check"]
    assert own["ratio"] == peer["p50_us"] / own["p50_us"] and peer["dtype"] == "bf16"
    assert float(peer["bytes"]) >= float(own["bytes"]) and peer["flops"] == own["flops"]
    assert any(line.split()[-1] == f"{own['check']:.5f}" for line in report.table_lines([own, peer]))


def test_decode_variant_specs():
    """Tuning fields: each a provider of its own name, settings joined by '+', clashes and unknown settings refused."""
    s = decode.parse("h128 b32 s4096 q1 pair pair+spans1 split1024+itemcost0 slots264 triton reduce+maxsplit2048")
    assert (s.h, s.b, s.s, s.q) == (128, 32, 4096, 1)
    assert s.variants == ("pair", "pair+spans1", "split1024+itemcost0", "slots264", "triton", "reduce+maxsplit2048")
    assert str(s) == "h128 b32 s4096 q1 pair pair+spans1 split1024+itemcost0 slots264 triton reduce+maxsplit2048"
    assert decode.parse(str(s)) == s
    assert decode.parse_variant("pair+spans1") == {"plan": {"_spans": True}, "variant": "pair"}
    assert decode.parse_variant("split1024+itemcost0") == {"plan": {"_min_split": 1024, "_max_split": 1024,
                                                                    "_item_cost": 0}}  # fmt: skip
    assert decode.parse_variant("gluon+spans0") == {"plan": {"_spans": False}, "backend": "gluon"}
    assert decode.parse_variant("reduce+minsplit512") == {"plan": {"_min_split": 512}, "reduce": True}
    assert decode.parse_variant("pair+spans1+spanscut") == {"plan": {"_spans": True, "_spans_mode": "cut"},
                                                            "variant": "pair"}  # fmt: skip
    assert decode.parse_variant("spanssnap") == {"plan": {"_spans_mode": "snap"}}
    assert decode.parse_variant("spans1+cutcost0") == {"plan": {"_spans": True, "_span_cut": 0}}
    assert decode.parse("h64 b128 s8192 q1 pair+spans1+spanscut").variants == ("pair+spans1+spanscut",)
    assert decode.parse_variant("pair+spans1+sms128") == {"plan": {"_spans": True, "num_sms": 128}, "variant": "pair"}
    for bad in ("spans0+spans1", "gluon+triton", "pair+triton", "reduce+pair", "split1024+minsplit64", "openmla",
                "split", "maxsplitx", "tile32x8x2", "pair+pair", "spanscut+spanssnap", "spans0+spanscut",
                "spans0+cutcost2", "spanssnap+cutcost2", "cutcost", "spanscut1", "sms", "sms64+sms128"):  # fmt: skip
        with pytest.raises(ValueError):
            decode.parse_variant(bad)
        with pytest.raises(ValueError):
            decode.parse(f"h2 b1 s16 {bad}")
    with pytest.raises(ValueError):
        decode.parse("h2 b1 s16 pair pair")  # one provider a name
    assert all(decode.parse(x).variants for x in decode.PRESETS["issue34"][:4])
    assert "pair+spans1+spanscut" in decode.parse(decode.PRESETS["issue34"][3]).variants


def test_decode_variant_run():
    """A point with variants: one row each beside the default, its check against the default's output; a variant
    that cannot run here (the Gluon tier on the CPU) leaves a note and no row."""
    dev = DEV
    notes = []
    ctx = BenchContext(dev, Timer(dev, rep=5, rounds=1), peers=False, quick=False, bw_gbs=1.0, peak_tflops=1.0,
                       env=dict(gpu="cpu", torch="t", triton="tr", git="x", label=""), note=notes.append)  # fmt: skip
    ctx.family = "decode"
    n = 16 if dev.type == "cpu" else 64  # splits are whole key tiles: 16 keys under the interpreter, 64 on a GPU
    spec = f"h2 b3 s{70 * n // 16}~{40 * n // 16} q1 maxsplit{2 * n}+itemcost0 split{n} triton+spans0"
    spec += f" reduce+maxsplit{2 * n} sms8"
    if dev.type == "cpu":
        spec += " gluon"
    rows = decode.run(decode.parse(spec), ctx)
    names = ["openmla", f"maxsplit{2 * n}+itemcost0", f"split{n}", "triton+spans0", f"reduce+maxsplit{2 * n}", "sms8"]
    assert [r["provider"] for r in rows] == names
    for r in rows[1:]:
        assert r["check"] > 0.9999 and float(r["p50_us"]) > 0 and r["shape"] == rows[0]["shape"], r
        assert r["dtype"] == "bf16" and r["bytes"] == rows[0]["bytes"]
    assert rows[0]["check"] == ""  # no peer
    if dev.type == "cpu":
        assert any(n.startswith("# gluon failed at") for n in notes), notes


def test_prefill_peer_layout():
    """The SDPA peer gets the batch as ``[B, H, L, D]`` and its output comes back as openmla's ``[T, H, d_v]``
    (the math backend stands in for cuDNN on the CPU)."""
    from torch.nn.attention import SDPBackend

    import openmla

    B, L, h = 2, 24, 2
    q, k = (torch.randn(B * L, h, 192, dtype=torch.bfloat16, device=DEV) for _ in range(2))
    v = torch.randn(B * L, h, 128, dtype=torch.bfloat16, device=DEV)
    cu = torch.arange(B + 1, dtype=torch.int32, device=DEV) * L
    out, _ = openmla.flash_attn_varlen(q, k, v, cu, cu, L, L, prefill.SCALE, causal=True)
    fn, ref = prefill._cudnn(q, k, v, B, L, backend=SDPBackend.MATH)
    assert ref.shape == out.shape and cosine(out, ref) > 0.9999


def test_compare_two_runs(tmp_path, capsys):
    from openmla.bench import compare

    def run(path, own_us, peer_us):
        rows = [
            dict(family="decode", shape="h1", dtype="fp8", provider="openmla", peer="flashmla", p50_us=own_us),
            dict(family="decode", shape="h1", dtype="bf16", provider="flashmla", peer="", p50_us=peer_us),
            dict(family="decode", shape="h2", dtype="bf16", provider="openmla", peer="", p50_us=own_us),
        ]
        report.write_csv(path, [dict(dict.fromkeys(report.COLUMNS, ""), **r) for r in rows])

    run(tmp_path / "a.csv", 20.0, 10.0)
    run(tmp_path / "b.csv", 10.0, 11.0)
    got = compare.compare(tmp_path / "a.csv", tmp_path / "b.csv")
    assert [(r["shape"], r["speedup"], r["peer_drift"]) for r in got] == [("h1", 2.0, 1.1), ("h2", 2.0, None)]
    assert compare.main([str(tmp_path / "a.csv"), str(tmp_path / "b.csv")]) == 0
    assert "2.000x" in capsys.readouterr().out


def test_default_families_skip_what_cannot_run(monkeypatch, capsys):
    """Without --family: a family that does not import (an older checkout) or lacks the preset is skipped, said;
    named with --family it is an error."""
    from openmla.bench.cli import _plan

    lean = types.ModuleType("lean_family")
    lean.OP, lean.PRESETS, lean.parse = "lean", {"default": ["x"]}, str
    monkeypatch.setitem(sys.modules, "lean_family", lean)
    monkeypatch.setattr(bench, "FAMILIES", {"decode": bench.FAMILIES["decode"], "ghost": "no_such_module_xyz",
                                            "lean": "lean_family"})  # fmt: skip
    monkeypatch.setattr("openmla.bench.cli.FAMILIES", bench.FAMILIES)
    args = types.SimpleNamespace(family=None, shapes="tiny", quick=False)
    assert list(_plan(args, torch.device("cpu"))) == ["decode"]
    out = capsys.readouterr().out
    assert "family ghost skipped" in out and "family lean skipped" in out
    with pytest.raises(ValueError, match="ghost"):
        _plan(types.SimpleNamespace(family="ghost", shapes="tiny", quick=False), torch.device("cpu"))
    with pytest.raises(ValueError, match="lean"):
        _plan(types.SimpleNamespace(family="decode,lean", shapes="tiny", quick=False), torch.device("cpu"))


def test_against_an_older_package(tmp_path):
    """--against: a renamed copy of openmla (benchmarks/prepare_old.sh's openmla_old) timed as provider "before"
    in the same rounds; its output checked against this one's."""
    import re
    import shutil

    import openmla

    old = tmp_path / "old" / "openmla_old"
    shutil.copytree(os.path.dirname(openmla.__file__), old, ignore=shutil.ignore_patterns("__pycache__", "bench"))
    for path in old.rglob("*.py"):  # prepare_old.sh's renaming
        text = re.sub(r"\bopenmla\.", "openmla_old.", path.read_text())
        text = re.sub(r"^(\s*)from openmla import", r"\1from openmla_old import", text, flags=re.M)
        path.write_text(re.sub(r"^(\s*)import openmla\b", r"\1import openmla_old", text, flags=re.M))
    (tmp_path / "old" / "REV").write_text("abc1234\n")
    specs = "decode:h2 b1 s16 q1 fp8;prefill:h2 n16 t32"
    argv = ["--shapes", specs, "--against", str(tmp_path / "old"), "--out", str(tmp_path), "--no-plot", *FAST]
    try:
        assert bench_main(argv) == 0
    finally:
        for name in [m for m in sys.modules if m == "openmla_old" or m.startswith("openmla_old.")]:
            del sys.modules[name]
        sys.path.remove(str(tmp_path / "old"))
    _, rows = _csv(tmp_path / "bench.csv")
    for fam in ("decode", "prefill"):
        own, before = (
            next(r for r in rows if r["family"] == fam and r["provider"] == p) for p in ("openmla", "before")
        )
        assert float(before["check"]) > 0.9999 and before["dtype"] == own["dtype"] and before["bytes"] == own["bytes"]
        assert math.isclose(float(own["speedup"]), float(before["p50_us"]) / float(own["p50_us"]), rel_tol=1e-6)
    assert json.loads((tmp_path / "bench.json").read_text())["meta"]["against"] == "abc1234"
    assert bench_main(["--against", str(tmp_path / "nothing"), "--out", str(tmp_path)]) == 2


def test_sparse_v4_variant_rows(monkeypatch):
    """A Gluon variant ("g:lazy") gets its own row at every V4 route, bytes and dtype those of the default (the
    Gluon kernel is stood in for by the Triton one on the CPU: the rows, not the kernel, are under test)."""
    from openmla.bench import sparse_v4

    dev = DEV
    ctx = BenchContext(dev, Timer(dev, rep=5, rounds=1), peers=False, quick=False, bw_gbs=1.0, peak_tflops=1.0,
                       env=dict(gpu="cpu", torch="t", triton="tr", git="x", label=""))  # fmt: skip
    ctx.family = "sparse_v4"

    def stand_in(shape, ctx, fns, call, out, lse):
        fns[sparse_v4._kernel_provider(shape)] = lambda: call(out.clone(), lse.clone(), _kernel="triton")

    monkeypatch.setattr(sparse_v4, "_add_kernel", stand_in)
    for spec in sparse_v4.PRESETS["tiny"]:
        rows = sparse_v4.run(sparse_v4.parse(spec + " g:lazy"), ctx)
        assert [r["provider"] for r in rows] == ["openmla", "g:lazy"], spec
        assert rows[1]["bytes"] == rows[0]["bytes"] and rows[1]["dtype"] == rows[0]["dtype"], spec


def _bench_dcp():
    spec = importlib.util.spec_from_file_location("bench_dcp", os.path.join(ROOT, "benchmarks", "bench_dcp.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bench_dcp_shapes():
    parse = _bench_dcp()._parse
    assert parse("h16 b128 s8192 q1", 2) == {"h": 16, "b": 128, "s": 8192, "q": 1, "i": 1}
    assert parse("H128 b32 s131072 q1 i4", 8) == {"h": 16, "b": 32, "s": 131072, "q": 1, "i": 4}
    for bad, word in (("H6 b1 s8 q1", "multiple"), ("h2 H4 b1 s8 q1", "multiple"), ("h2 b1 q1", "missing s"),
                      ("h2 b1 s8 q1 x3", "tokens"), ("h2 b1 s8 qq", "tokens")):  # fmt: skip
        with pytest.raises(ValueError, match=word):
            parse(bad, 4)


@pytest.mark.skipif(suite_device().type != "cpu", reason="gloo ranks on the CPU (the GPU run is benchmarks/gpu_run.sh)")
def test_bench_dcp_two_ranks(tmp_path):
    # two gloo ranks through torchrun: a row per provider, the communication alone beside the attention and the
    # whole call, each rank's KV bytes (half the keys)
    import subprocess

    out = tmp_path / "dcp.csv"
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.join(ROOT, "benchmarks", "bench_dcp.py"), "--shapes", "H4 b2 s40 q1", "--csv", str(out)]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "KV a rank" in res.stdout and "communication gather + reduce_scatter" in res.stdout, res.stdout
    rows = list(csv.DictReader(open(out)))
    assert [r["provider"] for r in rows] == ["local", "comm-gather", "comm-reduce_scatter", "comm-all_to_all",
                                             "dcp-plain-reduce_scatter", "dcp-plain-all_to_all"]  # fmt: skip
    assert {r["world_size"] for r in rows} == {"2"}
    assert {int(r["kv_bytes"]) for r in rows} == {2 * 20 * 576 * 4}  # b2 x 20 of 40 keys, fp32 on the CPU
