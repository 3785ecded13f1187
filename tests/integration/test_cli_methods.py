"""Every synchronous exchange method trains through the real CLI with 2 gloo workers and sends fewer bytes."""

from __future__ import annotations

import pytest
import yaml

from cli_helpers import metrics, run_cli
from tiny_corpus import tiny_config_dict

METHODS = {
    "dropping": ["exchange.method=dropping", "exchange.drop_ratio=0.99"],
    "dropping-layer-2bit": [
        "exchange.method=dropping",
        "exchange.threshold=layer",
        "exchange.quantize_bits=2",
    ],
    "local_mix-replace": [
        "exchange.method=local_mix",
        "exchange.local_mix.local_mode=replace",
        "exchange.local_mix.average_every=7",
    ],
    "local_mix-sum-floor-weighted": [
        "exchange.method=local_mix",
        "exchange.local_mix.local_mode=sum",
        "exchange.local_mix.average_every=7",
        "exchange.local_mix.local_weight=0.5",
        "exchange.min_tensor_density=0.002",
    ],
    "dgc": ["exchange.method=dgc", "train.optimizer=sgd", "train.lr=0.5", "train.clip_norm=0"],
    "dgc_adam": ["exchange.method=dgc_adam", "train.optimizer=sgd", "train.clip_norm=0"],
    "dgc_adam-avg5": [
        "exchange.method=dgc_adam",
        "train.optimizer=sgd",
        "train.clip_norm=0",
        "exchange.dgc_adam.average_every=5",
    ],
    "dgc_adam-plain": [
        "exchange.method=dgc_adam",
        "train.optimizer=sgd",
        "train.clip_norm=0",
        "exchange.dgc_adam.local_update=false",
    ],
    "sbc": ["exchange.method=sbc", "exchange.sbc.delay=3", "exchange.sbc.density=0.01"],
    "local_sgd": ["exchange.method=local_sgd", "exchange.local_sgd.sync_every=4"],
    "local_sgd-slowmo": [
        "exchange.method=local_sgd",
        "exchange.local_sgd.sync_every=4",
        "exchange.local_sgd.momentum=0.5",
    ],
    "diloco": ["exchange.method=diloco", "exchange.diloco.sync_every=4"],
}


@pytest.fixture(scope="module")
def dense_bytes_per_step(tmp_path_factory, reverse_corpus) -> float:
    tmp = tmp_path_factory.mktemp("dense")
    tree = tiny_config_dict(reverse_corpus, tmp / "model", max_steps=4, log_every=1)
    tree["valid"] = {"every": 0, "translate": False, "test_at_end": False}
    (tmp / "cfg.yml").write_text(yaml.safe_dump(tree))
    result = run_cli("nmt.cli.train", "--config", str(tmp / "cfg.yml"), "--workers", "2")
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [r for r in metrics(tmp / "model") if r["kind"] == "train"]
    return rows[-1]["bytes_sent"] / rows[-1]["step"]


@pytest.mark.parametrize("name", sorted(METHODS))
def test_method_trains_with_two_workers(name, write_config, tmp_path, dense_bytes_per_step):
    config = write_config(
        _extra={"valid": {"every": 0, "beam_size": 1, "max_sentences": 8, "test_at_end": False}},
        max_steps=24,
        log_every=6,
        warmup_steps=10,
    )
    result = run_cli("nmt.cli.train", "--config", str(config), "--workers", "2", *METHODS[name])
    assert result.returncode == 0, result.stderr[-3000:]
    rows = metrics(tmp_path / "model")
    train = [r for r in rows if r["kind"] == "train"]
    assert [r["step"] for r in train] == [6, 12, 18, 24]
    assert train[-1]["loss"] < train[0]["loss"], train
    sent = train[-1]["bytes_sent"] / 24
    assert 0 < sent < dense_bytes_per_step / 3, (sent, dense_bytes_per_step)
    valid = [r for r in rows if r["kind"] == "valid"]
    assert valid and valid[-1]["loss"] < 10
