"""RESULTS.md takes a suite that no current run has (e.g. jit) from the newest run in
results/history/, says so, and never lets a history run replace a current one (issue 19, item 6)."""
from __future__ import annotations

import json
from pathlib import Path

from pagedattn.bench import report

SAMPLE = Path(__file__).parent / "data" / "bench_sample_h200.json"


def _write(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


def test_jit_suite_comes_from_history_when_no_current_run_has_it(tmp_path):
    full = json.loads(SAMPLE.read_text())
    results = tmp_path / "results"
    current = json.loads(json.dumps(full))
    del current["suites"]["jit"]
    current["metadata"]["date"] = "2026-12-02T00:00:00+00:00"
    _write(results / "h200_new.json", current)
    old = json.loads(json.dumps(full))
    old["metadata"]["date"] = "2026-11-01T00:00:00+00:00"
    old["suites"]["decode"]["cases"][0]["id"] = "decode/FROM_HISTORY"
    _write(results / "history" / "h200_old.json", old)

    text = report.write_results_md(results, tmp_path / "RESULTS.md", include_samples=True).read_text()
    jit = text.split(f"## {report.SUITE_TITLES['jit']}", 1)[1]
    assert "`history/h200_old.json` (2026-11-01" in jit and "the newest run with this suite" in jit
    assert "| cold/" in jit and "| warm/" in jit and "| host/" in jit
    assert "FROM_HISTORY" not in text            # the current run's decode wins
    assert "h200_old.json` |" not in text        # not listed among the runs
    assert " launch per call" in jit or " launches per call" in jit


def test_no_history_folder_changes_nothing(tmp_path):
    results = tmp_path / "results"
    _write(results / "h200.json", json.loads(SAMPLE.read_text()))
    md = report.write_results_md(results, tmp_path / "RESULTS.md", include_samples=True)
    assert "history/" not in md.read_text()
