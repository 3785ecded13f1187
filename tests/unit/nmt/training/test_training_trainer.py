"""The trainer's own logic, in one process (world size 1, tiny reverse-task Transformer, no launcher).

Limits, the train-row arithmetic, skipping NaN/inf steps, validation bookkeeping (best, early stopping,
which scores a row holds), the training-time validation clock and the learning-rate schedule. One test runs
2 gloo ranks (tests/unit/compression/gloo_harness.py): the validated mark the ranks share.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from compression import ExchangeStats
from nmt.config import config_from_dict
from nmt.training.cadence import Cadence
from nmt.training.config import TrainConfig, ValidConfig
from nmt.training.distributed import WorkerInfo, latest_over_ranks
from nmt.training.errors import TrainingDiverged
from nmt.training.metrics import Limits, Progress
from nmt.training.setup import inverse_sqrt
from nmt.training.step_records import LogInterval, RunState, StepResult
from nmt.training.trainer import Trainer

from gloo_harness import run_ranks
from tiny_corpus import tiny_config_dict

pytestmark = pytest.mark.usefixtures("single_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def built(reverse_corpus: Path, tmp_path_factory: pytest.TempPathFactory):
    """One Trainer for the module (its vocabulary takes seconds to train; the model is tiny)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model_dir = tmp_path_factory.mktemp("trainer") / "model"
    config = config_from_dict(tiny_config_dict(reverse_corpus, model_dir, precision="fp32", device="cpu"))
    info = WorkerInfo(rank=0, world_size=1, local_rank=0, local_world_size=1)
    trainer = Trainer(config, info, torch.device("cpu"))
    torch.set_num_threads(threads)
    yield trainer
    trainer.close()


@pytest.fixture
def trainer(built: Trainer, monkeypatch: pytest.MonkeyPatch) -> Trainer:
    """The module's trainer with its own copy of the config and fresh run counters for each test."""
    config = copy.deepcopy(built.config)
    monkeypatch.setattr(built, "config", config)
    monkeypatch.setattr(built.evaluator, "config", config)
    monkeypatch.setattr(built, "cadence", Cadence(config.train, config.valid))
    monkeypatch.setattr(built, "state", RunState())
    return built


def quiet_progress() -> Progress:
    return Progress(is_main=False, bar=False, limits=Limits(), initial=0)


# ------------------------------------------------------------------------------------------- limits


def test_max_steps_makes_the_upcoming_step_the_last(trainer: Trainer):
    trainer.config.train.max_steps = 5
    assert not trainer._limit_reached(0.0, upcoming_step=4)
    assert trainer._limit_reached(0.0, upcoming_step=5)


def test_max_wall_s_counts_wall_time(trainer: Trainer):
    trainer.config.train.max_steps = 0
    trainer.config.train.max_wall_s = 10.0
    assert not trainer._limit_reached(9.9, upcoming_step=1)
    assert trainer._limit_reached(10.0, upcoming_step=1)


def test_max_train_s_counts_training_time_only(trainer: Trainer):
    trainer.config.train.max_steps = 0
    trainer.config.train.max_train_s = 10.0
    trainer.state.train_s = 9.9
    assert not trainer._limit_reached(1000.0, upcoming_step=1)  # validation and saving took the rest
    trainer.state.train_s = 10.0
    assert trainer._limit_reached(10.0, upcoming_step=1)


def test_max_epochs_ends_when_the_next_batch_belongs_to_a_later_epoch(
    trainer: Trainer, monkeypatch: pytest.MonkeyPatch
):
    trainer.config.train.max_steps = 0
    trainer.config.train.max_epochs = 2
    monkeypatch.setattr(trainer, "batches", SimpleNamespace(epoch=2))
    assert not trainer._limit_reached(0.0, upcoming_step=1)
    monkeypatch.setattr(trainer, "batches", SimpleNamespace(epoch=3))
    assert trainer._limit_reached(0.0, upcoming_step=1)


def test_without_limits_the_run_goes_on(trainer: Trainer):
    trainer.config.train.max_steps = 0
    trainer.state.train_s = 1e9
    assert not trainer._limit_reached(1e9, upcoming_step=10**9)


# ------------------------------------------------------------------------------------ train rows


def step_result(loss: float, tokens: int, bytes_sent: int, exchange_s: float) -> StepResult:
    return StepResult(
        loss_sum=loss,
        nll_sum=loss / 2,
        tokens=tokens,
        stop=False,
        stats=ExchangeStats(bytes_sent=bytes_sent),
        grad_norm=1.0,
        exchange_s=exchange_s,
    )


def test_log_interval_summary_averages_per_token_and_per_step():
    interval = LogInterval()
    interval.add(step_result(loss=300.0, tokens=100, bytes_sent=1000, exchange_s=0.25), seconds=0.5)
    interval.add(step_result(loss=500.0, tokens=300, bytes_sent=3000, exchange_s=0.75), seconds=1.5)
    assert interval.summary() == pytest.approx(
        {
            "loss": 800.0 / 400,  # per target token over the interval, not a mean of step means
            "nll": 400.0 / 400,
            "tokens": 400,
            "tok_per_s": 400 / 2.0,  # training seconds only
            "bytes_per_step": 2000.0,
            "exchange_s": 0.5,
        }
    )


def test_an_empty_log_interval_divides_by_nothing():
    assert LogInterval().summary() == {
        "loss": 0.0,
        "nll": 0.0,
        "tokens": 0,
        "tok_per_s": 0.0,
        "bytes_per_step": 0.0,
        "exchange_s": 0.0,
    }


# ----------------------------------------------------------------------------- NaN / inf steps


def test_non_finite_steps_are_counted_reset_by_a_good_step_and_stop_the_run(trainer: Trainer):
    trainer.config.train.max_bad_steps = 3
    for skip in (True, True, False, True, True):
        trainer.guard.count_bad_step(skip)
    assert (trainer.state.skipped_steps, trainer.state.bad_steps_in_row) == (4, 2)
    with pytest.raises(TrainingDiverged, match=r"NaN/inf in 3 consecutive steps \(train.max_bad_steps\)"):
        trainer.guard.count_bad_step(True)
    assert trainer.state.skipped_steps == 5


def test_max_bad_steps_0_never_stops(trainer: Trainer):
    trainer.config.train.max_bad_steps = 0
    for _ in range(50):
        trainer.guard.count_bad_step(True)
    assert trainer.state.bad_steps_in_row == 50


# The schedule advances on a skipped step too (steps are counted), so torch sees scheduler before optimizer.
@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")
def test_a_non_finite_loss_skips_the_update(trainer: Trainer):
    batch = next(iter(trainer.batches))
    params = trainer.flat.params
    saved = params.detach().clone()
    first = trainer.flat.layout[0]  # the embedding matrix: NaN in every row makes every loss NaN
    with torch.no_grad():
        params[first.offset : first.end] = float("nan")
    try:
        result = trainer.train_step([batch], stop_vote=False)
        assert math.isnan(result.loss_sum) and math.isnan(result.grad_norm)
        assert torch.equal(params[first.end :], saved[first.end :]), "a skipped step must not update"
        assert not trainer.flat.grads.any(), "the skipped step's gradient must not leak into the next"
        assert (trainer.state.step, trainer.state.skipped_steps, trainer.state.bad_steps_in_row) == (1, 1, 1)
    finally:
        with torch.no_grad():
            params.copy_(saved)

    result = trainer.train_step([batch], stop_vote=False)
    assert math.isfinite(result.loss_sum) and not torch.equal(params, saved)
    assert (trainer.state.step, trainer.state.skipped_steps, trainer.state.bad_steps_in_row) == (2, 1, 0)


# ------------------------------------------------------------------------------------ validation


def validate_with_losses(
    trainer: Trainer, monkeypatch: pytest.MonkeyPatch, losses: list[float]
) -> list[tuple[bool, bool]]:
    """Validate once per loss (dev loss scripted, no translation), at steps 10, 20, ..."""
    trainer.config.valid.translate = False
    scripted = iter(losses)
    monkeypatch.setattr(trainer.evaluator, "dev_loss", lambda src, tgt: (next(scripted), 100))
    outcomes = []
    for i in range(len(losses)):
        trainer.state.step = 10 * (i + 1)
        outcomes.append(trainer.validate(quiet_progress()))
    return outcomes


def test_validation_keeps_the_best_and_stops_early(trainer: Trainer, monkeypatch: pytest.MonkeyPatch):
    trainer.config.valid.early_stopping = 2
    outcomes = validate_with_losses(trainer, monkeypatch, [3.0, 2.5, 2.7, 2.6])
    assert outcomes == [(True, False), (True, False), (False, False), (False, True)]
    assert (trainer.state.best_step, trainer.state.bad_validations) == (20, 2)
    rows = [row for row in trainer.metrics.rows() if row["kind"] == "valid"][-4:]
    assert [row["loss"] for row in rows] == [3.0, 2.5, 2.7, 2.6]
    assert [row["step"] for row in rows] == [10, 20, 30, 40] and "bleu" not in rows[-1]


def test_an_improvement_resets_the_count_of_bad_validations(
    trainer: Trainer, monkeypatch: pytest.MonkeyPatch
):
    trainer.config.valid.early_stopping = 2
    outcomes = validate_with_losses(trainer, monkeypatch, [3.0, 3.1, 2.0, 2.5])
    assert outcomes == [(True, False), (False, False), (True, False), (False, False)]
    assert (trainer.state.best_step, trainer.state.bad_validations) == (30, 1)


def test_without_early_stopping_validation_never_stops(trainer: Trainer, monkeypatch: pytest.MonkeyPatch):
    trainer.config.valid.early_stopping = 0
    outcomes = validate_with_losses(trainer, monkeypatch, [1.0, 2.0, 3.0, 4.0, 5.0])
    assert not any(stop for _, stop in outcomes) and trainer.state.bad_validations == 4


def translate_as_refs(trainer: Trainer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Validation 'translates' the dev set into its references (BLEU 100), so only scoring is tested."""
    refs = lambda src, for_test=False: trainer.evaluator.dev_lines()[1]  # noqa: E731
    monkeypatch.setattr(trainer.evaluator, "translate", refs)


def test_validation_logs_the_listed_metrics_and_picks_by_bleu(
    trainer: Trainer, monkeypatch: pytest.MonkeyPatch
):
    translate_as_refs(trainer, monkeypatch)
    trainer.config.valid.max_sentences = 5
    trainer.config.valid.metrics = ["bleu"]
    assert trainer.validate(quiet_progress()) == (True, False)
    row = trainer.metrics.rows()[-1]
    assert row["bleu"] == pytest.approx(100.0) and trainer.state.best_bleu == row["bleu"]
    assert "chrf" not in row and "chrf_signature" not in row

    trainer.config.valid.metrics = ["bleu", "chrf"]
    trainer.validate(quiet_progress())
    assert trainer.metrics.rows()[-1]["chrf"] == pytest.approx(100.0)


def test_validation_stops_the_run_once_dev_bleu_reaches_the_target(
    trainer: Trainer, monkeypatch: pytest.MonkeyPatch
):
    translate_as_refs(trainer, monkeypatch)  # BLEU 100
    trainer.config.valid.max_sentences = 5
    trainer.config.valid.target_bleu = 100.5
    trainer.state.step = 10
    assert trainer.validate(quiet_progress()) == (True, False)  # 100 < 100.5: go on
    trainer.config.valid.target_bleu = 99.0
    trainer.state.step += 10
    assert trainer.validate(quiet_progress()) == (False, True)  # the best (100) has reached 99: stop


def test_target_bleu_needs_translation():
    with pytest.raises(ValueError, match="valid.target_bleu needs valid.translate"):
        ValidConfig(target_bleu=20.0, translate=False).validate()
    with pytest.raises(ValueError, match="valid.target_bleu must be >= 0"):
        ValidConfig(target_bleu=-1.0).validate()


def test_validation_tokenizes_bleu_for_the_target_language(trainer: Trainer, monkeypatch: pytest.MonkeyPatch):
    translate_as_refs(trainer, monkeypatch)
    trainer.config.valid.max_sentences = 5
    trainer.config.data.tgt_lang = "zh"
    trainer.validate(quiet_progress())
    assert "tok:zh" in trainer.metrics.rows()[-1]["bleu_signature"]


def test_valid_metrics_must_name_bleu():
    with pytest.raises(ValueError, match="valid.metrics must list bleu"):
        ValidConfig(metrics=["chrf"]).validate()
    with pytest.raises(ValueError, match="unknown metric 'ter'"):
        ValidConfig(metrics=["bleu", "ter"]).validate()
    ValidConfig(metrics=["bleu"]).validate()


# ------------------------------------------------------------------------ clock and lr schedule


def test_validation_clock_is_due_each_time_training_time_crosses_a_multiple(trainer: Trainer):
    trainer.config.valid.every_train_s = 10.0
    state = trainer.state
    state.train_s = 9.9
    assert not trainer._validation_clock_due()
    state.train_s = 10.0
    assert trainer._validation_clock_due()
    state.last_valid_train_s = 10.4  # validated there
    state.train_s = 19.9
    assert not trainer._validation_clock_due()
    state.train_s = 31.0  # two points passed since: one validation, not two
    assert trainer._validation_clock_due()


def _clocks_straddling_a_mark(rank: int, world_size: int) -> list[bool]:
    """Two ranks whose clocks straddle the 10 s mark when rank 0's clock calls for a validation: after it,
    neither clock comes due again before the 20 s mark (each rank's answers at three later clocks)."""
    cadence = Cadence(TrainConfig(), ValidConfig(every_train_s=10.0))
    clock = [10.004, 9.998][rank]  # rank 0 has crossed the mark, rank 1 is 6 ms behind
    last_valid = latest_over_ranks(clock, torch.device("cpu"))  # what Trainer.validate records
    return [cadence.validation_clock_due(clock + dt, last_valid) for dt in (0.01, 9.99, 10.01)]


def test_a_validation_counts_on_every_rank_when_the_clocks_straddle_its_mark():
    # before the fix each rank recorded its own clock: rank 1 (9.998) came due again at 10.008, a second
    # validation one step after the first (the doubled dev points of docs/results.md section 11)
    assert run_ranks(_clocks_straddling_a_mark, 2) == [[False, False, True]] * 2
    assert latest_over_ranks(3.5, torch.device("cpu")) == 3.5  # one process, no group: its own clock


def test_validation_records_the_latest_clock_of_all_ranks(trainer: Trainer, monkeypatch: pytest.MonkeyPatch):
    translate_as_refs(trainer, monkeypatch)
    trainer.config.valid.max_sentences = 5
    trainer.state.train_s = 9.998
    monkeypatch.setattr("nmt.training.trainer.latest_over_ranks", lambda value, device, group: 10.004)
    trainer.validate(quiet_progress())
    assert trainer.state.last_valid_train_s == 10.004


def test_validation_clock_off(trainer: Trainer):
    trainer.config.valid.every_train_s = 0.0
    trainer.state.train_s = 1e6
    assert not trainer._validation_clock_due()


def test_inverse_sqrt_warms_up_linearly_then_decays():
    factor = inverse_sqrt(4)
    assert [factor(s) for s in (0, 1, 2, 4, 16, 64)] == pytest.approx([0.25, 0.25, 0.5, 1.0, 0.5, 0.25])
    assert inverse_sqrt(0)(1) == 1.0 and inverse_sqrt(0)(1000) == 1.0
