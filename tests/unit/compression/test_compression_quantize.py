"""Quantized sparse messages: codes survive the wire bit-exactly, the decoded values follow the bucket scheme,
and what was not represented stays in the residual (sent + residual == input)."""

from __future__ import annotations

import pytest
import torch

from compression import ParamSpan, StepContext
from compression.config import ExchangeConfig
from compression.dropping import GradientDropping
from compression.quantize import dequantize, quantize
from compression.sparse_allgather import SparseAllGather


def values(n: int = 257, seed: int = 0) -> torch.Tensor:
    v = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    return v + torch.sign(v) * 0.1  # nonzero, like the entries a sparse message keeps


@pytest.mark.parametrize("bits", [1, 2])
@pytest.mark.parametrize("groups", [1, 3])
def test_wire_round_trip_is_exact(bits: int, groups: int) -> None:
    v = values()
    group_ids = torch.arange(v.numel()) % groups
    q = quantize(v, group_ids, groups, bits)
    assert int(q.codes.max()) < 2**bits
    indices = torch.arange(v.numel(), dtype=torch.int32) * 3
    wire = SparseAllGather(bits=bits, num_groups=groups)
    capacity = v.numel() + 5  # padding after the payload must be ignored
    message = wire.pack(indices, q, capacity)
    decoded = wire.unpack(message.unsqueeze(0), capacity, lambda idx: (idx // 3) % groups)
    assert decoded.counts == [v.numel()]
    torch.testing.assert_close(decoded.indices, indices.long(), atol=0, rtol=0)
    torch.testing.assert_close(decoded.values, q.dequantized, atol=0, rtol=0)
    torch.testing.assert_close(dequantize(q.codes, group_ids, q.scales, bits), q.dequantized, atol=0, rtol=0)
    assert (
        wire.payload_bytes(v.numel())
        == v.numel() * 4 + (v.numel() * bits + 7) // 8 + groups * 2 ** (bits - 1) * 4
    )


def test_one_bit_keeps_sign_and_group_mean_magnitude() -> None:
    v = values()
    q = quantize(v, torch.zeros(v.numel(), dtype=torch.long), 1, 1)
    torch.testing.assert_close(
        q.dequantized.abs(), torch.full_like(v, float(v.abs().mean())), atol=1e-6, rtol=0
    )
    assert torch.equal(torch.sign(q.dequantized), torch.sign(v))


def test_two_bit_uses_equal_width_buckets_with_their_means() -> None:
    v = values()
    mag = v.abs()
    q = quantize(v, torch.zeros(v.numel(), dtype=torch.long), 1, 2)
    split = float(mag.min() + (mag.max() - mag.min()) / 2)
    low, high = mag[mag < split], mag[mag >= split]
    torch.testing.assert_close(q.scales, torch.stack([low.mean(), high.mean()]), atol=1e-6, rtol=0)
    assert torch.equal(torch.sign(q.dequantized), torch.sign(v))
    # quantizing never increases the error beyond using one mean for everything
    one_bit = quantize(v, torch.zeros(v.numel(), dtype=torch.long), 1, 1)
    assert float((q.dequantized - v).norm()) < float((one_bit.dequantized - v).norm())


@pytest.mark.parametrize("bits", [1, 2])
def test_quantization_error_goes_to_the_residual(bits: int) -> None:
    layout = [ParamSpan("w", 0, (50, 40), "matrix")]
    ex = GradientDropping(ExchangeConfig(method="dropping", drop_ratio=0.95, quantize_bits=bits))
    g = torch.randn(2000, generator=torch.Generator().manual_seed(1))
    out = g.clone()
    stats = ex.reduce(out, StepContext(step=0, world_size=1, rank=0, layout=layout))
    assert stats.extra["sparse_count"] > 0
    sent_values = out[out != 0]
    assert sent_values.abs().unique().numel() <= 2 ** (bits - 1)  # only the bucket magnitudes travel
    torch.testing.assert_close(out + ex.state_dict()["residual"], g, atol=1e-6, rtol=0)
