"""Test harness: one suite, two shape sets.

Under the Triton interpreter on the CPU (the default on a machine without CUDA) the tests use tiny
shapes; on a CUDA machine the same files run at real shapes (``openmla.utils.testing.pick``).
Run the GPU set with ``make test-gpu`` (or ``OPENMLA_TEST_DEVICE=cuda python -m pytest -q``).
Tests marked ``gpu`` / ``hopper`` are skipped where no such device is used.
"""

from __future__ import annotations

import os
import sys

import openmla  # noqa: F401  (sets TRITON_INTERPRET before triton is imported)

# isort: split
import pytest
import torch

from openmla.utils.testing import on_gpu, suite_device

_torch_empty = torch.empty


def _poisoned_empty(*args, **kwargs):
    """torch.empty that fills floating tensors with NaN, so unwritten outputs are caught (fla)."""
    t = _torch_empty(*args, **kwargs)
    if t.is_floating_point() and t.numel() > 0:
        t.fill_(float("nan"))
    return t


@pytest.fixture(autouse=True)
def _nan_empty(monkeypatch):
    monkeypatch.setattr(torch, "empty", _poisoned_empty)
    yield


@pytest.fixture
def device() -> torch.device:
    return suite_device()


def pytest_collection_modifyitems(config, items):
    gpu = on_gpu()
    hopper = gpu and torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (OPENMLA_TEST_DEVICE=cuda)")
    skip_hopper = pytest.mark.skip(reason="needs an sm90 (Hopper) GPU")
    for item in items:
        if "gpu" in item.keywords and not gpu:
            item.add_marker(skip_gpu)
        if "hopper" in item.keywords and not hopper:
            item.add_marker(skip_hopper)


@pytest.fixture(autouse=True)
def _end_process_after_device_fault(request):
    """A kernel that faults (illegal address, trap) leaves the process's CUDA context unusable: every later
    test in the process would fail in its setup and hide which test faulted. After a GPU test, synchronise;
    on a device error name the test on stderr and end the process (pytest-xdist reports the test as crashed
    and starts a fresh worker; without xdist the run stops here instead of reporting a cascade)."""
    yield
    if not (on_gpu() and torch.cuda.is_available() and torch.cuda.is_initialized()):
        return
    try:
        torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001 - any error here is a device fault; the message says which
        sys.__stderr__.write(f"\nDEVICE FAULT after {request.node.nodeid}: {str(exc).splitlines()[0]}\n")
        sys.__stderr__.flush()
        os._exit(3)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(42)
    yield
