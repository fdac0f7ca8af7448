"""Multi-device checks run in one 8-device subprocess per test file and session.

A test file defines ``CHECKS = {name: fn}`` and, under ``if __name__ == "__main__"``, calls
``run_checks(CHECKS, sys.argv[1])``; its session fixture returns
``session_results(tmp_path_factory, __file__, "stem")``, and one parametrized test per check
reads its result. The subprocess gets 8 forced CPU devices (the file sets ``XLA_FLAGS`` before
importing JAX; ``JAX_PLATFORMS=cpu`` here, so also where a GPU is the default backend and
whatever platform the parent was told to use) and this checkout's paramstore.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest

import paramstore as ps
from paramstore._variable import abstract as _abstract


def run_checks(checks: Mapping[str, Callable[[], Any]], out: str) -> None:
    """Run every check in a fresh store with the seed reset; write results and timings."""
    results: dict[str, str] = {}
    timings: dict[str, float] = {}
    for name, fn in checks.items():
        t0 = time.perf_counter()
        try:
            ps.random.set_seed(0)
            with ps.VariableStore():
                fn()
            results[name] = "ok"
        except BaseException:
            results[name] = traceback.format_exc()
        timings[name] = time.perf_counter() - t0
    Path(out).write_text(json.dumps({"results": results, "timings": timings}))


def session_results(tmp_path_factory: Any, test_file: str, stem: str) -> dict[str, Any]:
    """Run ``test_file`` as the 8-device subprocess once per session (xdist workers share it)."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    out = root / f"{stem}.json"
    with open(root / f"{stem}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not out.exists():
                env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
                flags = [  # the file forces its own device count; other flags pass (conftest's)
                    flag
                    for flag in os.environ.get("XLA_FLAGS", "").split()
                    if not flag.startswith("--xla_force_host_platform_device_count")
                ]
                if flags:
                    env["XLA_FLAGS"] = " ".join(flags)
                env["JAX_PLATFORMS"] = "cpu"  # the forced devices are CPU devices
                # this checkout's paramstore, not the one the environment has installed
                # (and the tests' shared helpers, which the test file imports as a script too)
                tests_dir = Path(__file__).resolve().parent
                paths = [str(tests_dir.parent), str(tests_dir), env.get("PYTHONPATH")]
                env["PYTHONPATH"] = os.pathsep.join(filter(None, paths))
                proc = subprocess.run(
                    [sys.executable, test_file, str(out)],
                    env=env,
                    capture_output=True,
                    text=True,
                    timeout=600,
                )
                if not out.exists():
                    pytest.fail(
                        f"the multi-device subprocess failed (rc {proc.returncode}):\n"
                        f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
                    )
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return json.loads(out.read_text())


def multi_device_tests(
    checks: Mapping[str, Callable[[], Any]], test_file: str, stem: str
) -> tuple[Any, Any]:
    """The session fixture (named ``stem``) and the test, parametrized by check name, of a test
    file's ``checks``: assign both at module level so pytest collects them,
    ``results, test_multi_device = multi_device_tests(CHECKS, __file__, "layout_results")``."""

    @pytest.fixture(scope="session", name=stem)
    def results(tmp_path_factory: Any) -> dict[str, Any]:
        return session_results(tmp_path_factory, test_file, stem)

    @pytest.mark.parametrize("name", list(checks))
    def test_multi_device(name: str, request: pytest.FixtureRequest) -> None:
        result = request.getfixturevalue(stem)["results"][name]
        if result != "ok":
            pytest.fail(f"check_{name} failed in the 8-device subprocess:\n{result}", pytrace=False)

    return results, test_multi_device


def init_programs(run: Callable[[], Any]) -> list[list[Any]]:
    """Call ``run()`` and return the output shardings of each sharded initialization program
    it built (``paramstore._variable.abstract.init_program``), in order."""
    programs: list[list[Any]] = []
    real = _abstract.init_program

    def spy(makes: Any, shardings: Any) -> Any:
        programs.append(list(shardings))
        return real(makes, shardings)

    _abstract.init_program = spy
    try:
        run()
    finally:
        _abstract.init_program = real
    return programs
