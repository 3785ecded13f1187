"""bench/drop_anatomy.py: the per-tensor sums of a round from hand-made vectors, and a real 2-rank run whose
rows agree with what the method was asked to send."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from bench_helpers import load_bench

from tiny_corpus import tiny_config_dict

drop_anatomy = load_bench("drop_anatomy")


def test_a_round_is_read_from_the_residual_before_and_after() -> None:
    anatomy = drop_anatomy.RoundAnatomy(["enc.0.w", "dec.1.w"], [3, 2])
    grad = torch.tensor([1.0, 2.0, 0.5, 3.0, -1.0])
    anatomy.before(grad, None)
    # entries 1 and 3 sent (their residual dropped to the quantization error 0.25 / 0), the rest kept a = g
    anatomy.after(torch.tensor([1.0, 0.25, 0.5, 0.0, -1.0]))
    anatomy.before(grad, torch.tensor([1.0, 0.25, 0.5, 0.0, -1.0]))
    anatomy.after(torch.tensor([0.0, 2.25, 1.0, 3.0, -2.0]))  # a = [2, 2.25, 1, 3, -2]: entry 0 sent
    table = anatomy.snapshot()
    rows = drop_anatomy.anatomy_rows(2, anatomy.names, anatomy.lengths, table, ranks=1)
    enc, dec = rows
    assert enc["family"] == "enc.*.w" and enc["numel"] == 3 and enc["steps"] == 2
    # grad^2 per step: enc 1 + 4 + 0.25 = 5.25, dec 9 + 1 = 10; over two steps 10.5 and 20
    assert enc["grad_share"] == pytest.approx(10.5 / 30.5)
    # withheld g^2: step 1 enc 1 + 0.25, dec 1; step 2 enc 4 + 0.25, dec 9 + 1 -> 5.5 and 11
    assert enc["unsent_grad_share"] == pytest.approx(5.5 / 16.5)
    assert enc["unsent_fraction"] == pytest.approx(5.5 / 10.5)
    assert dec["unsent_fraction"] == pytest.approx(11 / 20)
    # residual^2: step 1 enc 1 + 0.0625 + 0.25, dec 1; step 2 enc 5.0625 + 1, dec 9 + 4
    assert enc["residual_share"] == pytest.approx(7.375 / 21.375)
    assert enc["density"] == pytest.approx((1 + 1) / 2 / 3) and dec["density"] == pytest.approx(1 / 2 / 2)
    # ages after step 2: enc [0, 1, 2], dec [1, 2]; never sent: enc entry 2, dec entry 1
    assert enc["mean_age"] == pytest.approx(1.0) and dec["mean_age"] == pytest.approx(1.5)
    assert enc["never_sent"] == pytest.approx(1 / 3) and dec["never_sent"] == pytest.approx(1 / 2)


def test_a_skipped_step_leaves_the_sums_alone() -> None:
    anatomy = drop_anatomy.RoundAnatomy(["w"], [2])
    anatomy.after(torch.tensor([1.0, 2.0]))  # no round started: nothing observed
    assert anatomy.snapshot()[:, :5].abs().sum() == 0 and int(anatomy.age.sum()) == 0


def test_a_two_rank_run_writes_rows_that_match_the_density_it_was_given(tmp_path, reverse_corpus) -> None:
    """A real run (torchrun, 2 gloo ranks, the trainer with validation): 4 steps of exact top-1% dropping,
    one row per sparsified tensor every 2 steps; each step sent between the top-k count and the capacity."""
    tree = tiny_config_dict(reverse_corpus, tmp_path / "run", max_steps=4, log_every=2)
    tree["exchange"] = {
        "method": "dropping",
        "drop_ratio": 0.99,
        "warmup_steps": 0,
        "threshold_estimator": "exact",
    }
    recipe = tmp_path / "recipe.yml"
    recipe.write_text(yaml.safe_dump(tree))
    argv = ["--workers", "2", "--config", str(recipe), "--every", "2", "valid.every=4"]
    assert drop_anatomy.main(argv) == 0
    rows = [json.loads(line) for line in (tmp_path / "run" / "anatomy.jsonl").read_text().splitlines()]
    assert sorted({r["step"] for r in rows}) == [2, 4]
    for step in (2, 4):
        at = [r for r in rows if r["step"] == step]
        for share in ("grad_share", "unsent_grad_share", "residual_share"):
            assert sum(r[share] for r in at) == pytest.approx(1.0)
        n = sum(r["numel"] for r in at)
        sent_per_step = sum(r["density"] * r["numel"] for r in at)
        assert 0.01 * n * 0.99 <= sent_per_step <= 1.2 * 0.01 * n + 1
        assert all(0 <= r["mean_age"] <= step and 0 <= r["never_sent"] <= 1 for r in at)
    metrics = (tmp_path / "run" / "metrics.jsonl").read_text()
    assert '"kind": "valid"' in metrics  # the watched run is nmt-train's: it validated

    summary = drop_anatomy.summarize(tmp_path / "run")
    assert sum(s["param_share"] for s in summary.values()) == pytest.approx(1.0)
    report = drop_anatomy.markdown([tmp_path / "run"])
    assert "| `decoder_layers.*.cross_attn.q.weight` |" in report  # layer numbers folded


def test_a_method_without_a_residual_is_refused_in_one_line(tmp_path, reverse_corpus) -> None:
    tree = tiny_config_dict(reverse_corpus, tmp_path / "run")
    tree["exchange"] = {"method": "dense"}
    recipe = tmp_path / "recipe.yml"
    recipe.write_text(yaml.safe_dump(tree))
    with pytest.raises(SystemExit, match="exchange.method=dense has no residual to watch"):
        drop_anatomy.main(["--workers", "1", "--config", str(recipe)])


def test_the_report_needs_rows(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="holds no rows"):
        drop_anatomy.summarize(tmp_path)
