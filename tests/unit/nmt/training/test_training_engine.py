"""The parts both trainers share, built without processes: cadence, smoothed weights, validation bookkeeping,
the dev set, error classification and the rank runner's exit codes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from nmt.config import ConfigError, config_from_dict
from nmt.data.corpus import CorpusError
from nmt.training.cadence import Cadence
from nmt.training.config import TrainConfig, ValidConfig
from nmt.training.distributed import EXIT_PEER_LOST
from nmt.training.errors import (
    PeerFailure,
    TrainingDiverged,
    communication_cause,
    is_communication_error,
    peer_failure_from,
)
from nmt.training.evaluator import Evaluator, ValidationRecord, judge, stop_early
from nmt.training.flat import flatten_model
from nmt.training.metrics import MetricsLog
from nmt.training.runner import run_rank
from nmt.training.smoothing import SmoothedWeights

from tiny_corpus import tiny_config_dict

# ------------------------------------------------------------------------------------------- cadence


def test_cadence_logs_every_log_every_steps_and_at_the_last():
    cadence = Cadence(TrainConfig(log_every=10), ValidConfig())
    assert [s for s in range(1, 31) if cadence.log_due(s, stop=False)] == [10, 20, 30]
    assert cadence.log_due(7, stop=True)


def test_cadence_validates_by_steps_or_by_the_training_clock():
    cadence = Cadence(TrainConfig(), ValidConfig(every=50, every_train_s=0.0))
    assert [s for s in range(1, 151) if cadence.validation_due(s)] == [50, 100, 150]
    assert cadence.validation_due(7, clock_due=True)
    off = Cadence(TrainConfig(), ValidConfig(every=0))
    assert not any(off.validation_due(s) for s in range(1, 200))


def test_cadence_saves_every_save_every_steps_and_never_at_0():
    assert [s for s in range(1, 10) if Cadence(TrainConfig(save_every=4), ValidConfig()).save_due(s)] == [
        4,
        8,
    ]
    assert not any(Cadence(TrainConfig(save_every=0), ValidConfig()).save_due(s) for s in range(1, 10))


def test_cadence_limits_each_end_the_run_and_0_is_off():
    off = TrainConfig(max_steps=0, max_wall_s=0, max_train_s=0, max_epochs=0)
    assert not Cadence(off, ValidConfig()).limit_reached(10**9, 1e9, 1e9, 10**6)
    for train, hit, miss in (
        (TrainConfig(max_steps=5), (5, 0, 0, 1), (4, 0, 0, 1)),
        (TrainConfig(max_steps=0, max_wall_s=10), (1, 10.0, 0, 1), (1, 9.9, 0, 1)),
        (TrainConfig(max_steps=0, max_train_s=10), (1, 99.0, 10.0, 1), (1, 99.0, 9.9, 1)),
        (TrainConfig(max_steps=0, max_epochs=2), (1, 0, 0, 3), (1, 0, 0, 2)),
    ):
        cadence = Cadence(train, ValidConfig())
        assert cadence.limit_reached(*hit) and not cadence.limit_reached(*miss)


# ------------------------------------------------------------------------------------------- smoothing


class Tied(torch.nn.Module):
    """Two names for one parameter, as a tied embedding/output projection has."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(3, 2)
        self.out = torch.nn.Linear(2, 3, bias=False)
        self.out.weight = self.embed.weight
        self.norm = torch.nn.LayerNorm(2)

    def parameter_kinds(self) -> dict[str, str]:
        return {"embed.weight": "embedding", "norm.weight": "vector", "norm.bias": "vector"}


def test_smoothed_weights_follow_the_parameters_and_swap_in_and_back():
    model = Tied()
    flat = flatten_model(model, model.parameter_kinds())
    start = flat.params.clone()
    smoothed = SmoothedWeights(flat, decay=0.75)
    flat.params.add_(4.0)
    smoothed.update()
    assert torch.allclose(smoothed.tensor, start + 1.0)  # 0.75 * start + 0.25 * (start + 4)
    moved = flat.params.clone()
    with smoothed.swapped_in():
        assert torch.equal(flat.params, smoothed.tensor)
    assert torch.equal(flat.params, moved)


def test_smoothed_state_names_tied_parameters_under_every_alias_and_loads_back():
    model = Tied()
    flat = flatten_model(model, model.parameter_kinds())
    smoothed = SmoothedWeights(flat, decay=0.5)
    flat.params.add_(2.0)
    smoothed.update()
    state = smoothed.model_state(model)
    assert set(state) == set(model.state_dict()) and "out.weight" in state
    assert torch.equal(state["out.weight"], state["embed.weight"])
    assert torch.equal(state["embed.weight"], model.embed.weight.detach() - 1.0)
    other = SmoothedWeights(flat, decay=0.5)
    other.load({"ema": state})
    assert torch.equal(other.tensor, smoothed.tensor)
    other.load({"ema": None})  # a checkpoint without smoothed weights: start from the parameters
    assert torch.equal(other.tensor, flat.params)


def test_smoothing_off_evaluates_the_parameters_themselves():
    model = Tied()
    flat = flatten_model(model, model.parameter_kinds())
    smoothed = SmoothedWeights(flat, decay=0.0)
    smoothed.update()
    with smoothed.swapped_in():
        pass
    assert smoothed.tensor is None and smoothed.model_state(model) is None


# ------------------------------------------------------------------------------------------- validation


def test_judge_keeps_the_best_counts_bad_validations_and_stops_early():
    record = ValidationRecord()
    outcomes = [
        judge(record, step, score, early_stopping=2) for step, score in [(1, -5.0), (2, 3.0), (3, 2.0)]
    ]
    assert outcomes == [(True, False), (True, False), (False, False)]  # the first counts whatever its score
    assert judge(record, 4, 3.0, early_stopping=2) == (False, True)  # equal is not better
    assert (record.best_step, record.best_bleu, record.bad_validations) == (2, 3.0, 2)
    assert judge(record, 5, 3.5, early_stopping=2) == (True, False) and record.bad_validations == 0


def test_judge_stops_once_the_best_bleu_reaches_the_target():
    record = ValidationRecord()
    assert judge(record, 1, 4.0, early_stopping=0, target_bleu=5.0) == (True, False)
    assert judge(record, 2, 5.0, early_stopping=0, target_bleu=5.0) == (True, True)  # reached: equal counts
    assert judge(record, 3, 4.5, early_stopping=0, target_bleu=5.0) == (False, True)  # the best stays reached
    assert not stop_early(ValidationRecord(), early_stopping=0, target_bleu=5.0)  # nothing validated yet
    assert not stop_early(record, early_stopping=0, target_bleu=0.0)  # 0 = off


def test_dev_files_of_unequal_length_are_a_corpus_error(reverse_corpus: Path, tmp_path: Path):
    short = tmp_path / "dev.tgt"
    short.write_text("one line\n", encoding="utf-8")
    tree = tiny_config_dict(reverse_corpus, tmp_path / "model")
    tree["data"]["valid"]["tgt"] = str(short)
    config = config_from_dict(tree)
    metrics = MetricsLog(tmp_path / "metrics.jsonl", enabled=False)
    evaluator = Evaluator(
        config, torch.nn.Identity(), (None, None), torch.device("cpu"), torch.no_grad(), metrics
    )
    with pytest.raises(CorpusError, match="dev.tgt has 1"):
        evaluator.dev_lines()
    tree["data"]["valid"]["tgt"] = tree["data"]["valid"]["src"]
    tree["valid"] = {"max_sentences": 3}
    evaluator.config = config_from_dict(tree)
    src, tgt = evaluator.dev_lines()
    assert len(src) == len(tgt) == 3


# ------------------------------------------------------------------------------------------- errors


def test_gloo_transport_errors_and_dist_errors_are_communication_errors():
    closed = RuntimeError(
        "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer"
    )
    assert is_communication_error(closed)
    assert communication_cause(closed) == "connection closed: that process exited or died"
    assert is_communication_error(RuntimeError("Application timeout caused pair closure"))
    assert communication_cause(RuntimeError("Application timeout caused pair closure")) == "timed out"
    assert is_communication_error(dist.DistBackendError("NCCL watchdog"))
    assert not is_communication_error(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_communication_error(ValueError("[gloo] not a RuntimeError"))
    failure = peer_failure_from(closed, "lost worker rank 2")
    assert isinstance(failure, PeerFailure) and str(failure).startswith(
        "lost worker rank 2 (connection closed"
    )
    assert peer_failure_from(KeyError("x"), "lost") is None


@pytest.mark.parametrize(
    ("raised", "code", "text"),
    [
        (ConfigError("model.heads must be >= 1"), 2, "model.heads must be >= 1"),
        (CorpusError("train.src is empty"), 2, "train.src is empty"),
        (TrainingDiverged("step 3: NaN"), 1, "step 3: NaN"),
        (
            PeerFailure("no push from worker rank 2"),
            EXIT_PEER_LOST,
            "no push from worker rank 2; the job stops",
        ),
        (KeyboardInterrupt(), 130, "interrupted; resume with the same command"),
        (OSError(28, "No space left on device"), 2, "No space left on device"),
    ],
)
def test_the_rank_runner_reports_each_failure_as_one_line_with_its_exit_code(
    raised: BaseException, code: int, text: str, tmp_path: Path, reverse_corpus: Path, capsys, monkeypatch
):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    config = config_from_dict(tiny_config_dict(reverse_corpus, tmp_path / "model", device="cpu"))

    def body(*_args) -> None:
        raise raised

    threads = torch.get_num_threads()
    try:
        assert run_rank(config, body, role=lambda info: "worker") == code
    finally:
        torch.set_num_threads(threads)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("nmt-train: error: rank 0 (worker): ") and text in err[0]


def test_the_rank_runner_lets_programming_errors_through(tmp_path: Path, reverse_corpus: Path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    config = config_from_dict(tiny_config_dict(reverse_corpus, tmp_path / "model", device="cpu"))

    def body(*_args) -> None:
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    threads = torch.get_num_threads()
    try:
        with pytest.raises(RuntimeError, match="mat1"):
            run_rank(config, body)
    finally:
        torch.set_num_threads(threads)
