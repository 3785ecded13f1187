"""The loss watch: a runaway mean stops the run, noise and a falling loss do not, and it resumes exactly."""

from __future__ import annotations

import math

from nmt.training.divergence import DivergenceWatch


def test_a_falling_noisy_loss_never_fires():
    watch = DivergenceWatch(window=10, margin=0.5)
    for step in range(500):
        loss = 9.0 * math.exp(-step / 100) + 2.0 + (0.4 if step % 7 == 0 else -0.1)
        assert watch.observe(loss) is None
    assert 2.0 < watch.reference() < 2.5


def test_a_blow_up_in_the_first_steps_fires_against_the_first_loss():
    watch = DivergenceWatch(window=100, margin=0.5)
    assert watch.observe(7.6) is None
    reason = watch.observe(9.9e8)
    assert reason is not None and "mean over the last 2 steps" in reason and "against 7.6 at best" in reason


def test_a_slow_climb_fires_once_the_window_mean_is_past_the_margin():
    watch = DivergenceWatch(window=10, margin=0.5)
    for _ in range(50):
        assert watch.observe(3.0) is None
    fired_at = None
    for step in range(1, 100):
        if watch.observe(3.0 + 0.1 * step) is not None:
            fired_at = step
            break
    # the window mean reaches 4.5 (1.5 x 3.0) once the last 10 losses average 4.5: at step 20
    assert fired_at == 20


def test_non_finite_losses_are_left_to_the_nan_guard_and_the_window_0_is_off():
    watch = DivergenceWatch(window=10, margin=0.5)
    watch.observe(5.0)
    assert watch.observe(float("nan")) is None and list(watch.losses) == [5.0]
    off = DivergenceWatch(window=0, margin=0.5)
    assert off.observe(5.0) is None and off.observe(1e9) is None and off.judge(1e9, 5.0) is None


def test_judge_compares_the_same_batches_before_and_after_and_records_nothing():
    watch = DivergenceWatch(window=4, margin=0.5)
    for loss in (5.0, 4.0, 3.0, 2.0):
        watch.observe(loss)
    before = watch.state_dict()
    assert watch.judge(6.0, before=5.0) is None  # a hard batch: far above the window's mean, but it fell
    assert "against 2 before the update" in watch.judge(3.1, before=2.0)
    assert "nan" in watch.judge(float("nan"), before=2.0)
    assert watch.state_dict() == before


def test_the_state_round_trips_so_a_resumed_run_decides_the_same():
    losses = [6.0, 5.0, 4.5, 4.0, 3.9, 3.8, 4.1, 3.7]
    whole = DivergenceWatch(window=3, margin=0.2)
    resumed = DivergenceWatch(window=3, margin=0.2)
    for loss in losses[:5]:
        whole.observe(loss)
        resumed.observe(loss)
    restored = DivergenceWatch(window=3, margin=0.2)
    restored.load_state_dict(resumed.state_dict())
    for loss in [*losses[5:], 4.6, 5.0]:
        assert whole.observe(loss) == restored.observe(loss)
    empty = DivergenceWatch(window=3, margin=0.2)
    empty.load_state_dict({})  # a checkpoint from before the watch
    assert empty.first_loss is None and not empty.losses
