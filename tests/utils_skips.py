"""Skips are never silent: the recorder behind tests/conftest.py and tests_serving/conftest.py.

Every skip is listed with its reason (pytest -rs); a skipped module, and a skipped test that guards a feature the
docs claim, is also listed at the end of the run and written to $DIFFTRANSFORMER_SKIP_REPORT (one JSON object per
line), from which scripts/test.sh prints CI's summary, by name and reason, for every venv it ran (the serving run's
too). Each conftest keeps its own ``GUARDED_CLAIMS`` and hands pytest's reports to one :class:`SkipRecorder`."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest


class SkipRecorder:
    """``guarded_claims``: node-id prefix → the claim the tests it matches guard. ``suite``: the test folder. Each
    prefix must match a collected test when the whole suite runs (else the session fails: a renamed test would otherwise
    stop being guarded unnoticed)."""

    def __init__(self, guarded_claims: dict[str, str], suite: Path):
        self.guarded_claims = guarded_claims
        self.suite = suite
        self.skips: list[dict] = []

    def claim_of(self, nodeid: str) -> str | None:
        return next((claim for prefix, claim in self.guarded_claims.items() if nodeid.startswith(prefix)), None)

    def _record(self, nodeid: str, longrepr, module: bool) -> None:
        reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
        self.skips.append(
            {
                "test": nodeid,
                "reason": reason.removeprefix("Skipped: "),
                "module": module,
                "claim": self.claim_of(nodeid),
            }
        )

    def collectreport(self, report) -> None:
        """pytest_collectreport: a module skipped as a whole (a module-level ``importorskip``, ``pytest.skip``)."""
        if report.skipped:
            self._record(report.nodeid, report.longrepr, module=True)

    def runtest_logreport(self, report) -> None:
        """pytest_runtest_logreport: a test skipped in its set-up (``skipif`` marks, fixtures) or its call."""
        if report.skipped and report.when in ("setup", "call"):
            self._record(report.nodeid, report.longrepr, module=False)

    def check_guards(self, session) -> None:
        """pytest_collection_finish: on a whole-suite run, every ``guarded_claims`` prefix matches a collected test (or
        the module it names was skipped whole)."""
        if session.config.getoption("keyword", None) or session.config.getoption("markexpr", None):
            return  # a -k / -m selection runs part of the suite on purpose
        collected = [item.nodeid for item in session.items]
        files = {nodeid.split("::")[0] for nodeid in collected} | {s["test"] for s in self.skips if s["module"]}
        suite = {path.relative_to(self.suite.parent).as_posix() for path in self.suite.rglob("test_*.py")}
        if not suite <= files:
            return  # a part of the suite (CI's newest and lowest runs, single files): only the whole suite checks
        missing = [
            prefix
            for prefix in self.guarded_claims
            if not any(nodeid.startswith(prefix) for nodeid in collected)
            and not any(s["test"].startswith(prefix.split("::")[0]) for s in self.skips)
        ]
        if missing:
            raise pytest.UsageError(f"GUARDED_CLAIMS entries match no collected test (renamed?): {missing}")

    def terminal_summary(self, terminalreporter) -> None:
        """pytest_terminal_summary: the guarded skips, here and (one write) in $DIFFTRANSFORMER_SKIP_REPORT."""
        if os.environ.get("PYTEST_XDIST_WORKER"):
            return  # the controller reports what every worker skipped
        guarded = list({s["test"]: s for s in self.skips if s["module"] or s["claim"]}.values())
        if guarded:
            terminalreporter.section("skips of whole modules or of tests guarding a claimed feature")
            for s in guarded:
                what = "module" if s["module"] else f"guards: {s['claim']}"
                terminalreporter.write_line(f"SKIPPED {s['test']} ({what}): {s['reason']}")
        path = os.environ.get("DIFFTRANSFORMER_SKIP_REPORT")
        if path and guarded:
            venv = os.environ.get("DIFFTRANSFORMER_VENV", sys.prefix)
            lines = "".join(json.dumps({**s, "venv": venv}) + "\n" for s in guarded)
            with open(path, "a", encoding="utf-8") as out:  # one append: the serving run writes beside the others
                out.write(lines)
