"""Test harness: one suite, two shape sets.

Under the Triton interpreter on the CPU (the default on a machine without CUDA) the tests use tiny
shapes; on a CUDA machine the same files run at real shapes (``openmla.utils.testing.pick``).
Run the GPU set with ``make test-gpu`` (or ``OPENMLA_TEST_DEVICE=cuda python -m pytest -q``).
Tests marked ``gpu`` / ``hopper`` are skipped where no such device is used.
``--fail-log PATH`` keeps what a run killed before its summary would lose (see ``_FailLog``).
"""

from __future__ import annotations

import os
import sys
import time

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


def pytest_addoption(parser):
    parser.addoption(
        "--fail-log", metavar="PATH", default=None,
        help="append every failed or errored report (nodeid, phase, duration, traceback, captured output) to PATH "
        "as it arrives, and one line per started and finished test to PATH.progress",
    )  # fmt: skip


class _FailLog:
    """Writes reports as they reach the controller (under xdist too), each write flushed: a run that ``timeout``
    kills keeps the tracebacks of its failures and, in ``.progress``, how far it got and each test's time."""

    def __init__(self, path: str):
        self.path, self.progress, self.t0, self.runs = path, path + ".progress", time.time(), {}
        for p in (self.path, self.progress):
            open(p, "w").close()

    def _write(self, path: str, text: str) -> None:
        with open(path, "a") as f:
            f.write(text)

    def _line(self, what: str, nodeid: str, duration: float | None = None) -> None:
        """``seconds since the start<TAB>start|passed|failed|error|skipped|crashed<TAB>test seconds<TAB>nodeid``"""
        took = "" if duration is None else f"{duration:.2f}"
        self._write(self.progress, f"{time.time() - self.t0:.1f}\t{what}\t{took}\t{nodeid}\n")

    def pytest_runtest_logstart(self, nodeid, location):
        self._line("start", nodeid)

    def _report(self, rep, when: str) -> None:
        worker = getattr(getattr(getattr(rep, "node", None), "gateway", None), "id", "")
        label = "FAILED" if when in ("call", "???") else "ERROR"
        head = f"{'=' * 20} {label} {rep.nodeid} [{when}] {getattr(rep, 'duration', 0.0):.2f}s {worker}"
        body = [head, rep.longreprtext or "(no traceback)"]
        body += [f"{'-' * 8} {name} {'-' * 8}\n{text[-20000:]}" for name, text in rep.sections if text]
        self._write(self.path, "\n".join(body) + "\n\n")

    def pytest_runtest_logreport(self, report):
        if report.failed:
            self._report(report, report.when)
        if report.when not in ("setup", "call", "teardown"):  # xdist: a crashed worker's test ("???")
            self._line("crashed", report.nodeid)
            return
        outcome, total = self.runs.get(report.nodeid, ("passed", 0.0))
        if report.failed:
            outcome = "failed" if report.when == "call" else "error"
        elif report.skipped and outcome == "passed":
            outcome = "skipped"
        self.runs[report.nodeid] = (outcome, total + report.duration)

    def pytest_runtest_logfinish(self, nodeid, location):
        outcome, total = self.runs.pop(nodeid, ("unknown", 0.0))
        self._line(outcome, nodeid, total)

    def pytest_collectreport(self, report):
        if report.failed:
            self._report(report, "collect")


def pytest_configure(config):
    path = config.getoption("--fail-log")
    if path and not hasattr(config, "workerinput"):  # the xdist controller (or a run without xdist) writes
        config.pluginmanager.register(_FailLog(path), "openmla-fail-log")


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
