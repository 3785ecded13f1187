"""bench/exchange_cost.py: op names fall in the groups its profile reports, and a real 2-rank run on the tiny
corpus times every asked method's phases, with the dense all-reduce seen as a collective."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml
from bench_helpers import ROOT, load_bench

from tiny_corpus import tiny_config_dict

exchange_cost = load_bench("exchange_cost")


def test_profiled_ops_are_grouped_by_what_they_do() -> None:
    assert exchange_cost.group_of("gloo:all_reduce") == "collective"
    assert exchange_cost.group_of("c10d::allgather_") == "collective"
    assert exchange_cost.group_of("aten::topk") == "selection"
    assert exchange_cost.group_of("aten::clone") == "copy"
    assert exchange_cost.group_of("aten::addcmul_") == "arithmetic"


def test_two_ranks_time_each_method_on_the_tiny_corpus(reverse_corpus: Path, tmp_path: Path) -> None:
    config = tmp_path / "tiny.yml"
    config.write_text(yaml.safe_dump(tiny_config_dict(reverse_corpus, tmp_path / "model")))
    vocab = tmp_path / "vocab" / "spm.model"  # missing: the script trains it once before the ranks start
    methods = ["dense-fp32", "dgc_adam-99-local"]
    command = [sys.executable, str(ROOT / "bench" / "exchange_cost.py"), "--config", str(config)]
    command += ["--vocab", str(vocab), "--methods", *methods]
    command += ["--warmup", "1", "--steps", "3", "--profile", "1"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [r["method"] for r in rows] == methods
    assert vocab.exists()
    for row in rows:
        assert row["workers"] == 2 and row["steps"] == 3
        assert row["reduce_ms"] > 0 and row["optimizer_ms"] > 0 and row["pass_ms"] > 0
        assert row["total_ms"] == row["reduce_ms"] + row["optimizer_ms"] + row["after_step_ms"]
    dense, sparse = rows
    assert dense["profile_ms"]["collective"] > 0  # the all-reduce ran between the two ranks
    assert sparse["profile_ms"].get("selection", 0) > 0  # dgc_adam selected its entries
