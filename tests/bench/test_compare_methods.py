"""bench/compare_methods.py's report: every figure comes from the runs' rows (here, rows the test writes)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from bench_helpers import load_bench

compare_methods = load_bench("compare_methods")
RunSummary, table = compare_methods.RunSummary, compare_methods.table


def test_the_table_gives_the_dev_bleu_curve_and_the_bytes_of_one_sync(tmp_path: Path) -> None:
    rows = [
        {"step": 50, "kind": "train", "bytes_sent": 1000, "syncs": 1, "bytes_per_sync": 1000.0},
        {"step": 100, "kind": "train", "bytes_sent": 4000, "syncs": 2, "bytes_per_sync": 1500.0},
        {"step": 100, "kind": "valid", "loss": 4.5, "bleu": 1.5, "chrf": 20.0},
        {"step": 200, "kind": "valid", "loss": 4.0, "bleu": 3.25, "chrf": 25.0, "bytes_sent": 8000},
        {"step": 200, "kind": "test", "bleu": 4.0},
    ]
    run = RunSummary("diloco", ["exchange.method=diloco"], tmp_path, rows=rows, n_params=1000, returncode=0)
    header, _, line = table([run], None)
    cells = dict(zip(header.strip("|").split(" | "), line.strip("|").split(" | ")))
    assert cells["dev BLEU by validation"] == "1.50 / 3.25"
    assert cells["bytes/sync"] == "1.33 KB"  # (1000 * 1 + 1500 * 2) / 3 syncs
    assert cells["bytes/step"] == "40 B" and cells["test BLEU"] == "4.00"
    dense = RunSummary("dense", [], tmp_path, rows=[{"step": 10, "kind": "train", "bytes_sent": 40}])
    assert (
        dict(zip(header.strip("|").split(" | "), table([dense], 10)[2].strip("|").split(" | ")))["bytes/sync"]
        == "–"
    )


def test_an_archived_run_is_restored_skipped_and_reported_in_a_later_session(tmp_path: Path) -> None:
    """A session's finished run goes to --archive; the next session (no models/) restores it, trains
    nothing (nmt-train here is `false`: it would fail the run) and reports the archived figures."""
    main = compare_methods.main
    runs_dir, archive_dir = tmp_path / "models", tmp_path / "archive"
    finished = runs_dir / "dense"
    finished.mkdir(parents=True)
    rows = [
        '{"step": 10, "kind": "valid", "loss": 4.0, "bleu": 2.5}',
        '{"step": 10, "kind": "test", "bleu": 3.5}',
    ]
    (finished / "metrics.jsonl").write_text("\n".join(rows) + "\n")
    record = {"name": "dense", "overrides": ["exchange.method=dense"], "returncode": 0}
    (finished / "compare_run.json").write_text(json.dumps(record))
    (finished / "step-00000010").mkdir()  # weights: not archived
    common = ["--runs-dir", str(runs_dir), "--archive", str(archive_dir), "--plots", str(tmp_path / "plots")]
    assert main(["--report-only", *common, "--out", str(tmp_path / "first.md")]) == 0
    assert sorted(p.name for p in (archive_dir / "dense").iterdir()) == ["compare_run.json", "metrics.jsonl"]

    shutil.rmtree(runs_dir)  # a new session: models/ is gone
    out = tmp_path / "second.md"
    argv = ["--config", "recipe.yml", "--skip-existing", "--nmt-train", "false", *common, "--out", str(out)]
    assert main([*argv, "--run", "dense", "exchange.method=dense"]) == 0
    assert (runs_dir / "dense" / "metrics.jsonl").exists()
    line = next(x for x in out.read_text().splitlines() if x.startswith("| dense |"))
    assert line.startswith("| dense | `exchange.method=dense` | 10 | 4.000 | 2.50 | 2.50 | 2.50 | 3.50 |")
    # the recorded exit status, not "–" (the run is known to have finished); no CPU: the record predates it
    assert line.endswith("| 0 | – |")


def test_more_workers_than_cores_is_passed_on_to_nmt_train_only_when_asked(tmp_path: Path) -> None:
    """The 4-worker quality runs on a 2-core machine need nmt-train's --allow-oversubscribe; without the flag
    nmt-train refuses them, so the command must carry it exactly when the user passed it."""
    for flag, runs_dir in (["--allow-oversubscribe"], tmp_path / "yes"), ([], tmp_path / "no"):
        argv = ["--config", "recipe.yml", "--workers", "4", "--nmt-train", "false"]
        argv += [
            "--runs-dir",
            str(runs_dir),
            *flag,
            "--out",
            str(tmp_path / "report.md"),
            "--plots",
            str(tmp_path / "plots"),
        ]
        compare_methods.main([*argv, "--run", "dense", "exchange.method=dense"])
        command = json.loads((runs_dir / "dense" / "compare_run.json").read_text())["command"]
        assert command[:5] == ["false", "--config", "recipe.yml", "--workers", "4"]
        assert ("--allow-oversubscribe" in command) == bool(flag)


def test_a_command_line_with_arguments_can_stand_in_for_nmt_train(tmp_path: Path) -> None:
    """`--nmt-train '.venv/bin/python bench/drop_anatomy.py'` (a script taking nmt-train's arguments) is split
    into its words, not run as one executable of that name."""
    argv = ["--config", "recipe.yml", "--nmt-train", "false --every 50", "--runs-dir", str(tmp_path / "runs")]
    argv += ["--out", str(tmp_path / "report.md"), "--plots", str(tmp_path / "plots")]
    compare_methods.main([*argv, "--run", "dropping", "exchange.method=dropping"])
    command = json.loads((tmp_path / "runs" / "dropping" / "compare_run.json").read_text())["command"]
    assert command[:4] == ["false", "--every", "50", "--config"]


def test_each_run_records_the_cpu_it_trained_on_and_the_table_names_it(tmp_path: Path) -> None:
    """The same bf16 run differs across CPU models: a report mixing machines says which row ran where."""
    argv = ["--config", "recipe.yml", "--nmt-train", "false", "--runs-dir", str(tmp_path / "runs")]
    argv += ["--out", str(tmp_path / "report.md"), "--plots", str(tmp_path / "plots")]
    compare_methods.main([*argv, "--run", "dense", "exchange.method=dense"])
    recorded = json.loads((tmp_path / "runs" / "dense" / "compare_run.json").read_text())["cpu"]
    assert recorded == compare_methods.cpu_model() and recorded.strip()
    line = next(x for x in (tmp_path / "report.md").read_text().splitlines() if x.startswith("| dense |"))
    assert line.endswith(f"| {recorded} |")
