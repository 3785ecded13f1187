"""Golomb-Rice coding of sparse positions: SBC's "optimal position encoding" (Sattler et al. 2018).

Why: a sparse binary message is only positions (one shared value per tensor), so the position bits
*are* the message. Gaps between kept positions of a Bernoulli(p) mask are geometric, and a Rice code
(Golomb code with parameter M = 2^b) is close to the entropy bound for them: about 8.1 bits per
position at p = 0.01 instead of 32 for a raw int32 index (docs/sbc.md, "Measured bits per position").

Code word for one gap (gap = distance to the previous position, the first measured from -1), with
v = gap - 1, q = v >> b, r = v & (2^b - 1): q one-bits, a zero-bit, then the b bits of r (MSB first).
The stream holds exactly these code words' bits, laid out in two sections so that both directions
are vectorised (no per-bit or per-gap Python loop):

    [ unary parts of all n code words (1^q_1 0 1^q_2 0 ...) ][ n remainders, b bits each ][ pad to byte ]

The bit count is the same as interleaving the code words; the decoder finds the end of the unary
section as the n-th zero bit, so only n and b travel in the header (the caller's job).
"""

from __future__ import annotations

import math

import torch

GOLDEN_RATIO = (1.0 + math.sqrt(5.0)) / 2.0
MAX_RICE_PARAMETER = 40  # gaps are < 2^40 in any tensor we will meet; keeps shifts well inside int64
_BIT_WEIGHTS = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8)
_BIT_SHIFTS = torch.tensor([7, 6, 5, 4, 3, 2, 1, 0], dtype=torch.uint8)


def rice_parameter(p: float) -> int:
    """b* = 1 + floor(log2(ln(phi - 1) / ln(1 - p))) for a mask of density p (Sattler et al. 2018).

    Natural logarithms in both places (consistent bases); densities above ~0.38 give b* = 0 (pure unary).
    """
    if not 0.0 < p < 1.0:
        return 0
    ratio = math.log(GOLDEN_RATIO - 1.0) / math.log1p(-p)
    return min(max(0, 1 + math.floor(math.log2(ratio))), MAX_RICE_PARAMETER)


def expected_bits_per_position(p: float, b: int | None = None) -> float:
    """b̄ = b + 1 / (1 - (1 - p)^(2^b)): expected code length per position of a Bernoulli(p) mask.

    b defaults to `rice_parameter(p)`. This is Sattler et al.'s expected code length, without the extra
    bit that the authors' later code adds (`get_bits` in felisat/federated-learning, compression_utils.py).
    """
    if b is None:
        b = rice_parameter(p)
    if p >= 1.0:
        return float(b + 1)
    return b + 1.0 / -math.expm1((2**b) * math.log1p(-p))


def gaps_of(positions: torch.Tensor) -> torch.Tensor:
    """v_i = gap_i - 1 for sorted, distinct positions (int64); the first gap is measured from -1."""
    previous = torch.cat([positions.new_full((1,), -1), positions[:-1]])
    return positions - previous - 1


def rice_cost_bits(values: torch.Tensor, b: int) -> int:
    """Exact code length in bits of the values v (= gap - 1) under Rice parameter b."""
    return int((values >> b).sum().item()) + values.numel() * (1 + b)


def choose_rice_parameter(values: torch.Tensor, domain_size: int) -> int:
    """Cheapest of b* - 1, b*, b* + 1 on the actual gaps, b* taken from the density n / domain_size."""
    n = values.numel()
    if n == 0:
        return 0
    b_star = rice_parameter(n / max(domain_size, 1))
    candidates = [b for b in (b_star, b_star - 1, b_star + 1) if 0 <= b <= MAX_RICE_PARAMETER]
    costs = [rice_cost_bits(values, b) for b in candidates]
    return candidates[costs.index(min(costs))]  # ties keep b* (listed first)


def _pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """0/1 uint8 tensor -> bytes (uint8), MSB first, zero-padded to a whole byte."""
    pad = (-bits.numel()) % 8
    if pad:
        bits = torch.cat([bits, bits.new_zeros(pad)])
    return (bits.view(-1, 8) * _BIT_WEIGHTS.to(bits.device)).sum(dim=1, dtype=torch.uint8)


def _unpack_bits(data: torch.Tensor) -> torch.Tensor:
    """bytes (uint8) -> 0/1 uint8 tensor, MSB first."""
    return ((data.reshape(-1, 1) >> _BIT_SHIFTS.to(data.device)) & 1).view(-1)


def rice_encode(positions: torch.Tensor, b: int) -> tuple[torch.Tensor, int]:
    """Encode sorted, distinct, non-negative positions; returns (bytes as uint8 tensor, exact bit count)."""
    positions = positions.to(torch.int64)
    n = positions.numel()
    if n == 0:
        return torch.empty(0, dtype=torch.uint8, device=positions.device), 0
    values = gaps_of(positions)
    if bool((values < 0).any()):
        raise ValueError("rice_encode: positions must be sorted, distinct and non-negative")
    quotients = values >> b
    # Unary section: all ones except one zero terminating each code word.
    terminators = torch.cumsum(quotients + 1, dim=0) - 1
    unary_bits = int(terminators[-1].item()) + 1
    bits = torch.ones(unary_bits + n * b, dtype=torch.uint8, device=positions.device)
    bits[terminators] = 0
    if b > 0:
        remainders = values & ((1 << b) - 1)
        shifts = torch.arange(b - 1, -1, -1, dtype=torch.int64, device=positions.device)
        bits[unary_bits:] = ((remainders.view(-1, 1) >> shifts) & 1).view(-1).to(torch.uint8)
    return _pack_bits(bits), bits.numel()


def max_encoded_bytes(n: int, b: int, domain_size: int) -> int:
    """An upper bound on the stream length of n positions in [0, domain_size): what a decoder may read."""
    if n == 0:
        return 0
    # sum of quotients <= sum(v) / 2^b <= (domain_size - n) / 2^b
    unary_bits = n + max(domain_size - n, 0) // (1 << b)
    return (unary_bits + n * b + 7) // 8


def rice_decode(data: torch.Tensor, n: int, b: int) -> tuple[torch.Tensor, int]:
    """Decode n positions from the start of `data` (uint8); returns (int64 positions, bytes consumed).

    `data` may extend past the stream (the next tensor's message): only the first n zero-bits of the
    unary section and the n*b remainder bits after it are read.
    """
    if n == 0:
        return torch.empty(0, dtype=torch.int64, device=data.device), 0
    bits = _unpack_bits(data)
    zeros = torch.nonzero(bits == 0).view(-1)
    if zeros.numel() < n:
        raise ValueError(f"rice_decode: stream ends after {zeros.numel()} of {n} code words")
    terminators = zeros[:n]
    unary_bits = int(terminators[-1].item()) + 1
    total_bits = unary_bits + n * b
    if total_bits > bits.numel():
        raise ValueError(f"rice_decode: stream has {bits.numel()} bits, code words need {total_bits}")
    previous = torch.cat([terminators.new_full((1,), -1), terminators[:-1]])
    values = (terminators - previous - 1) << b
    if b > 0:
        weights = torch.pow(2, torch.arange(b - 1, -1, -1, dtype=torch.int64, device=data.device))
        remainder_bits = bits[unary_bits:total_bits].view(n, b).to(torch.int64)
        values = values + (remainder_bits * weights).sum(dim=1)
    positions = torch.cumsum(values + 1, dim=0) - 1
    return positions, (total_bits + 7) // 8
