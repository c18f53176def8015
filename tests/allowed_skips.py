"""The skip policy: under CI (env CI=true, which .ci/run sets) a skipped test fails the run unless its reason is on
ALLOWED_SKIPS, so an extra that .ci/run installs and that is missing or broken (vLLM's venv, llama.cpp's build, the
sweep plugins) is a failure there, not a quiet skip. Elsewhere skips stay skips: a local checkout may lack an extra.

tests/conftest.py takes the two hooks below; they run in each pytest-xdist worker, before the report is sent on.
"""
from __future__ import annotations

import os

import pytest

# The skips CI allows, as {the start of the reason: why it is allowed}. Every skip in the tests today names
# something .ci/run installs, and none needs a GPU, so none is allowed:
#   tests/test_served.py needs_vllm (also in test_producer, test_engine_parity) and tests/test_targets.py
#     pytest.skip(vllm_missing()): vLLM's venv, from scripts/setup_vllm.sh;
#   tests/test_llamacpp.py needs_llamacpp: llama.cpp's build, from scripts/setup_llamacpp.sh;
#   tests/test_sweeps.py importorskip: the sweep extra, from scripts/setup.sh (pip install -e ".[data,test,sweep]").
# A test that can only run on a GPU skips with a reason of its own, added here with why CI may skip it.
ALLOWED_SKIPS: dict[str, str] = {}


def under_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def refused(report) -> str | None:
    """The one-line failure a skipped report becomes under CI when its reason is not allowed, else None (xfails and
    reports that did not skip are left alone)."""
    if not report.skipped or hasattr(report, "wasxfail") or not under_ci():
        return None
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    reason = reason.removeprefix("Skipped: ")
    if any(reason.startswith(allowed) for allowed in ALLOWED_SKIPS):
        return None
    return (f"skipped under CI=true, and the reason is not in ALLOWED_SKIPS (tests/allowed_skips.py): {reason} "
            "-- install what it names (.ci/run's set-up), or allow it there with why")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    message = refused(report)
    if message:
        report.outcome, report.longrepr = "failed", message
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    """A module-level skip (pytest.importorskip at import, pytest.skip(allow_module_level=True)) under the same rule."""
    report = yield
    message = refused(report)
    if message:
        report.outcome, report.longrepr = "failed", message
    return report
