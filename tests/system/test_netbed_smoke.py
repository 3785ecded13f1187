"""Smoke test of the slow-network bed (bench/netbed.py): gloo across two shaped namespaces.

Why: benchmarks of sparse exchange on a slow link are only meaningful if the bed really carries
gloo traffic between separate network stacks, really limits the rate, and leaves nothing behind.
Skips (with the reason) where the bed cannot be built: not root, or no network namespaces.
"""

from __future__ import annotations

import importlib.util
import os
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load_netbed():
    spec = importlib.util.spec_from_file_location("netbed", ROOT / "bench" / "netbed.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["netbed"] = module  # dataclasses look the module up by name
    spec.loader.exec_module(module)
    return module


netbed = _load_netbed()

ALL_REDUCE = """
import datetime, os, torch, torch.distributed as dist
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
rank = dist.get_rank()
t = torch.full((1000,), float(rank + 1))
dist.all_reduce(t)
print(f"rank={rank} addr={os.environ['NETBED_ADDR']} sum={t[0].item()} same={bool((t == t[0]).all())}")
dist.destroy_process_group()
"""


@pytest.fixture(scope="module")
def bed_available() -> None:
    if os.geteuid() != 0:
        pytest.skip("netbed needs root (network namespaces and tc)")
    ok, reason = netbed.check()
    if not ok:
        pytest.skip(f"netbed unavailable here: {reason}")


@pytest.mark.netns
def test_gloo_all_reduce_across_shaped_namespaces(bed_available: None, tmp_path: Path) -> None:
    bed = netbed.NetBed(hosts=2, bandwidth="100mbit")
    with bed:
        # The link really is limited: one TCP stream gets close to, and not above, 100 Mbit/s.
        mbit = netbed.measure_throughput(bed, nbytes=2_000_000)
        assert 50 < mbit < 105, f"100mbit link measured {mbit:.1f} Mbit/s"

        command = f"OMP_NUM_THREADS=1 {shlex.quote(sys.executable)} -c {shlex.quote(ALL_REDUCE)}"
        result = bed.run(command, timeout=60, log_dir=tmp_path, echo="none", cwd=ROOT)
        logs = {r.host: r.log.read_text() for r in result.results}
        assert result.ok, f"netbed run failed: {logs}"
        assert "rank=0 addr=10.77.0.1 sum=3.0 same=True" in logs[0]
        assert "rank=1 addr=10.77.0.2 sum=3.0 same=True" in logs[1]

    # Teardown removed every namespace of this bed, and nothing ever appeared in the root namespace.
    assert netbed.list_namespaces(bed.name) == []
    assert netbed.list_root_links(netbed.PREFIX) == []
    root_links = netbed.list_root_links("")
    assert not [name for name in root_links if name.startswith(("nbveth", "nbport", "nbbr"))]


@pytest.mark.netns
def test_failed_host_ends_the_run(bed_available: None, tmp_path: Path) -> None:
    with netbed.NetBed(hosts=2) as bed:
        result = bed.run(
            '[ "$NETBED_HOST" = 1 ] && exit 3; sleep 60', timeout=30, log_dir=tmp_path, echo="none"
        )
    assert not result.ok and not result.timed_out
    assert result.returncode == 3
    assert result.seconds < 10, "a failed host must end its peers, not leave them waiting"
