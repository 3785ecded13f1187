"""Golomb-Rice position coding: exact round trips, and bits per position near the expected b̄."""

from __future__ import annotations

import pytest
import torch

from compression.golomb import (
    choose_rice_parameter,
    expected_bits_per_position,
    gaps_of,
    max_encoded_bytes,
    rice_decode,
    rice_encode,
    rice_parameter,
)


def round_trip(positions: torch.Tensor, domain: int, b: int | None = None) -> torch.Tensor:
    if b is None:
        b = choose_rice_parameter(gaps_of(positions), domain)
    data, n_bits = rice_encode(positions, b)
    assert data.dtype == torch.uint8 and data.numel() == (n_bits + 7) // 8
    assert data.numel() <= max_encoded_bytes(positions.numel(), b, domain)
    # The receiver sees the stream followed by other bytes: it must stop at the right place.
    trailing = torch.tensor([0, 255, 0, 17], dtype=torch.uint8)
    decoded, used = rice_decode(torch.cat([data, trailing]), positions.numel(), b)
    assert used == data.numel()
    return decoded


@pytest.mark.parametrize("p", [0.5, 0.1, 0.01, 0.001])
def test_random_masks_round_trip(p: float) -> None:
    gen = torch.Generator().manual_seed(int(p * 1e6))
    for n in (1, 7, 1000, 50_000):
        positions = torch.nonzero(torch.rand(n, generator=gen) < p).view(-1)
        assert torch.equal(round_trip(positions, n), positions)


@pytest.mark.parametrize(
    "positions, domain",
    [
        ([], 100),  # empty
        (list(range(64)), 64),  # all set: gaps of 1, b = 0
        ([0], 1000),  # first position only
        ([999], 1000),  # last position only
        ([417], 1000),  # single position
        ([0, 999], 1000),  # first and last
        ([0, 1, 2, 997, 998, 999], 1000),  # clusters at both ends
    ],
)
def test_edge_cases_round_trip(positions: list[int], domain: int) -> None:
    pos = torch.tensor(positions, dtype=torch.int64)
    assert torch.equal(round_trip(pos, domain), pos)


@pytest.mark.parametrize("b", [0, 1, 5, 13, 31])
def test_any_parameter_round_trips(b: int) -> None:
    """A badly chosen b costs bits but never correctness (b = 0 is pure unary)."""
    gen = torch.Generator().manual_seed(b)
    positions = torch.randperm(5000, generator=gen)[:40].sort().values
    assert torch.equal(round_trip(positions, 5000, b=b), positions)


def test_unsorted_positions_are_rejected() -> None:
    with pytest.raises(ValueError, match="sorted"):
        rice_encode(torch.tensor([5, 3]), 2)


def test_truncated_stream_is_an_error() -> None:
    positions = torch.arange(0, 1000, 10)
    data, _ = rice_encode(positions, 3)
    with pytest.raises(ValueError):
        rice_decode(data[: data.numel() // 2], positions.numel(), 3)


def test_rice_parameter_matches_the_worked_values() -> None:
    # Natural logarithms in both places (docs/sbc.md): p = 0.1, 0.01, 0.001 -> b* = 3, 6, 9
    assert [rice_parameter(p) for p in (0.1, 0.01, 0.001)] == [3, 6, 9]
    assert expected_bits_per_position(0.01) == pytest.approx(8.11, abs=0.005)
    assert expected_bits_per_position(0.01, b=7) == pytest.approx(8.38, abs=0.005)  # the paper's number
    assert rice_parameter(1.0) == 0 and rice_parameter(0.9) == 0


@pytest.mark.parametrize("p", [0.1, 0.01, 0.001])
def test_bits_per_position_near_expected(p: float) -> None:
    """Measured stream bits / position on a Bernoulli(p) mask within 2 % of b̄ (Sattler et al. 2018)."""
    n = 4_000_000
    gen = torch.Generator().manual_seed(1234)
    positions = torch.nonzero(torch.rand(n, generator=gen) < p).view(-1)
    b = choose_rice_parameter(gaps_of(positions), n)
    data, n_bits = rice_encode(positions, b)
    measured = n_bits / positions.numel()
    assert measured == pytest.approx(expected_bits_per_position(p), rel=0.02)
    decoded, _ = rice_decode(data, positions.numel(), b)
    assert torch.equal(decoded, positions)
