"""`benchmarks.profile_grant` drives whole loads through the real servicer and runtime.

A diagnostic, so the test checks only that it still completes loads (it raises when a
load does not end in one answer and one release) and reports a positive cost.
"""

from __future__ import annotations

import pytest

from benchmarks import profile_grant


def test_profile_grant_runs_whole_loads(capsys: pytest.CaptureFixture[str]) -> None:
    assert profile_grant.main(["--blocks", "4", "--loads", "20"]) == 0
    out = capsys.readouterr().out
    assert "4 blocks:" in out and "µs of kvrc's Python per load" in out
    assert float(out.split(":")[1].split("µs")[0]) > 0


def test_profile_grant_refuses_bad_arguments() -> None:
    with pytest.raises(SystemExit):
        profile_grant.main(["--loads", "0"])
