"""CI's skip policy (tests/allowed_skips.py): under CI=true a skip whose reason is not allowed fails the run, at
set-up (skipif), in the test (pytest.skip, importorskip) and at collection (a module-level importorskip); an allowed
reason and an xfail stay as they are, and without CI every skip stays a skip. Each case is a tiny inline test file
run in this process with the policy as its only plugin."""
from __future__ import annotations

import pytest

import allowed_skips

pytest_plugins = ["pytester"]

INLINE = """
import pytest

@pytest.mark.skipif(True, reason="vLLM is not installed: run scripts/setup_vllm.sh")
def test_marked():
    pass

def test_in_body():
    pytest.importorskip("no_such_module_anywhere", reason="the sweep extra: pip install -e '.[sweep]'")

def test_allowed():
    pytest.skip("needs a GPU: flex_attention's backward")

@pytest.mark.xfail(reason="known", strict=True)
def test_xfail():
    assert False

def test_passes():
    pass
"""
MODULE_SKIP = """
import pytest
pytest.importorskip("no_such_module_anywhere")

def test_never_collected():
    pass
"""


def run(pytester):
    """The inline tests with the policy as their one plugin (already imported here, hence no assertion rewriting)."""
    return pytester.runpytest_inprocess("-p", "allowed_skips", "-rfEs",
                                        "-W", "ignore::pytest.PytestAssertRewriteWarning")


def test_the_suite_runs_under_the_policy(request):
    """tests/conftest.py hands the policy's hooks to this session (each xdist worker's too)."""
    for hook in ("pytest_runtest_makereport", "pytest_make_collect_report"):
        impls = getattr(request.config.hook, hook).get_hookimpls()
        assert getattr(allowed_skips, hook) in [impl.function for impl in impls], hook


@pytest.fixture
def policy(monkeypatch):
    monkeypatch.setattr(allowed_skips, "ALLOWED_SKIPS", {"needs a GPU": "CI has no GPU"})


def test_unallowed_skips_fail_under_ci(pytester, monkeypatch, policy):
    monkeypatch.setenv("CI", "true")
    pytester.makepyfile(test_inline=INLINE)
    result = run(pytester)
    result.assert_outcomes(passed=1, skipped=1, xfailed=1, failed=1, errors=1)  # skipif fails at set-up: an error
    for line in ("ERROR*test_marked - skipped under CI=true, and the reason is not in ALLOWED_SKIPS "
                 "(tests/allowed_skips.py): vLLM is not installed*",
                 "FAILED*test_in_body - skipped under CI=true*: the sweep extra*", "SKIPPED*needs a GPU*"):
        result.stdout.fnmatch_lines([line])
    assert result.ret == pytest.ExitCode.TESTS_FAILED


def test_skips_stay_skips_without_ci(pytester, monkeypatch, policy):
    for value in (None, "false"):
        if value is None:
            monkeypatch.delenv("CI", raising=False)
        else:
            monkeypatch.setenv("CI", value)
        pytester.makepyfile(test_inline=INLINE)
        result = run(pytester)
        result.assert_outcomes(passed=1, skipped=3, xfailed=1)
        assert result.ret == pytest.ExitCode.OK


def test_a_module_level_skip_fails_collection_under_ci(pytester, monkeypatch):
    monkeypatch.setenv("CI", "true")
    pytester.makepyfile(test_module_skip=MODULE_SKIP)
    result = run(pytester)
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*not in ALLOWED_SKIPS*could not import 'no_such_module_anywhere'*"])
    monkeypatch.delenv("CI")
    result = run(pytester)
    result.assert_outcomes(skipped=1)
