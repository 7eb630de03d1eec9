"""The command line: the ``generate --json`` contract and the demo."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from openmla.cli import main
from openmla.engine import EngineConfig, LLMEngine, load_model
from openmla.utils.testing import on_gpu, suite_device

PROMPTS = [[5, 6, 7], [9], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]]


DEV = suite_device().type  # the CLI runs where the suite runs (CPU: the interpreter)


def _expected(n, device=DEV):
    model, _ = load_model("tiny", seed=0, device=device, dtype=torch.float32)
    return LLMEngine(model, EngineConfig(max_model_len=64, cuda_graphs=False)).generate(PROMPTS, n)


def _args(n, *extra):
    args = ["generate", "--max-new-tokens", str(n), "--json", "--device", DEV, "--dtype", "float32"]
    for p in PROMPTS:
        args += ["--prompt-ids", ",".join(map(str, p))]
    return args + list(extra)


def test_generate_json_contract(capsys):
    assert main(_args(5)) == 0
    out = capsys.readouterr().out.strip().splitlines()
    ids = json.loads(out[-1])  # the last line of stdout
    assert isinstance(ids, list) and [len(x) for x in ids] == [5, 5, 5]
    assert all(isinstance(t, int) for x in ids for t in x)
    assert ids == _expected(5)  # greedy, prompt order, prompts excluded


def test_generate_speculative_and_fp8(capsys):
    assert main(_args(5, "--speculate", "2")) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == _expected(5)
    assert main(_args(3, "--kv-cache-dtype", "fp8")) == 0
    ids = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [len(x) for x in ids] == [3, 3, 3]  # fp8 may change greedy choices; the contract holds


def test_python_m_openmla_generate():
    """The ``python -m openmla`` entry point in a fresh process."""
    proc = subprocess.run(
        [sys.executable, "-m", "openmla", "generate", "--prompt-ids", "5,6,7", "--prompt-ids", "9",
         "--max-new-tokens", "3", "--device", DEV, "--dtype", "float32", "--json"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    ids = json.loads(proc.stdout.strip().splitlines()[-1])
    assert ids == [x[:3] for x in _expected(3)[:2]]


def test_generate_bad_input(capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", "--prompt-ids", "5,x", "--max-new-tokens", "2"])
    assert e.value.code == 2
    assert main(["generate", "--prompt-ids", "5,100000", "--max-new-tokens", "2", "--device", DEV]) == 2
    assert "vocabulary" in capsys.readouterr().err
    assert main(["generate", "--prompt-ids", "5", "--max-new-tokens", "1000", "--device", DEV]) == 2


@pytest.mark.skipif(on_gpu(), reason="the GPU variant below runs the demo on cuda")
def test_demo_cpu(capsys):
    assert main(["demo", "--device", DEV, "--max-new-tokens", "6"]) == 0
    out = capsys.readouterr().out
    assert "tokens/s" in out and "acceptance rate" in out and "max |logit diff|" in out
    assert out.strip().endswith("OK")


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_demo_cuda(capsys, kv):
    assert main(["demo", "--device", "cuda", "--kv-cache-dtype", kv]) == 0
    out = capsys.readouterr().out
    assert "cuda graphs on" in out and out.strip().endswith("OK")


def _break(how):
    """A ``load_model`` whose model is wrong: every attention's softmax scale x1.02, or every sparse layer's indexer
    weights negated (other picks, which its logits still follow)."""
    import openmla.engine as engine_pkg

    real = engine_pkg.load_model

    def load(*args, **kw):
        model, sd = real(*args, **kw)
        with torch.no_grad():
            for attn in model.attention_layers:
                if how == "scale":
                    attn.sm_scale *= 1.02
                else:
                    attn.indexer.weights_proj.weight.neg_()
        return model, sd

    return load


def test_demo_v32_checks_the_picks(capsys):
    """V3.2: the picks are compared with transformers' own, the logits checked over the engine's picks."""
    assert main(["demo", "--device", DEV, "--model", "tiny-v32", "--dtype", "float32", "--max-new-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert "indexer picks differing from transformers': 0 of " in out and "over the engine's indexer picks" in out
    assert out.strip().endswith("OK")


@pytest.mark.parametrize("how", ["scale", "indexer"])
def test_demo_fails_on_a_wrong_model(capsys, monkeypatch, how):
    """A wrong attention fails the logits over the engine's picks; a wrong indexer the picks' comparison."""
    import openmla.engine as engine_pkg

    monkeypatch.setattr(engine_pkg, "load_model", _break(how))
    assert main(["demo", "--device", DEV, "--model", "tiny-v32", "--dtype", "float32", "--max-new-tokens", "1"]) == 1
    err = capsys.readouterr().err
    assert "MISMATCH" in err and (how == "scale" or "indexer picks differ from transformers'" in err), err
