"""Methods whose replicas drift (local_mix, sbc): one model, held by every rank, is validated and saved.

The case that used to go wrong: `valid.every` equal to the averaging period, so the parameters were averaged
inside `after_step` right before validation; the smoothed weights (train.ema_decay) were not averaged with
them, and each rank validated its own smoothed copy. Real gloo ranks run the real Trainer.fit here.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nmt.checkpoint import step_dir_name
from nmt.config import config_from_dict
from nmt.training.distributed import WorkerInfo, destroy_process_group, free_port, init_process_group
from nmt.training.trainer import Trainer

from tiny_corpus import tiny_config_dict

PERIOD = 5  # local_mix: average_every; sbc: delay; and valid.every
EXCHANGE = {  # each method's own options; an option of another method would be an error
    "local_mix": {"drop_ratio": 0.9, "local_mix": {"average_every": PERIOD}},
    "sbc": {"sbc": {"delay": PERIOD}},
}


def _config(corpus: Path, model_dir: Path, method: str):
    tree = tiny_config_dict(corpus, model_dir, max_steps=2 * PERIOD, ema_decay=0.8, log_every=PERIOD)
    tree["exchange"] = {"method": method, **EXCHANGE[method]}
    tree["valid"] = {"every": PERIOD, "beam_size": 1, "max_sentences": 4, "test_at_end": False}
    return config_from_dict(tree)


def _train(config, info: WorkerInfo, world: int) -> dict:
    """Run Trainer.fit, recording each rank's smoothed weights around the validation at the averaging step."""
    trainer = Trainer(config, info, torch.device("cpu"))
    seen: dict = {"layout": trainer.flat.layout}
    synchronize = trainer.synchronize

    def recording_synchronize() -> None:
        if trainer.state.step == PERIOD and "before" not in seen:
            gathered = [torch.empty_like(trainer.ema) for _ in range(world)]
            dist.all_gather(gathered, trainer.ema)
            seen["rank_average"] = torch.stack(gathered).mean(0)
            seen["before"] = trainer.ema.clone()
            synchronize()
            seen["ema"], seen["params"] = trainer.ema.clone(), trainer.flat.params.clone()
        else:
            synchronize()

    trainer.synchronize = recording_synchronize  # type: ignore[method-assign]
    trainer.fit()
    return seen


def _worker(rank: int, world: int, port: int, corpus: Path, model_dir: Path, method: str, out: Path) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    info = WorkerInfo(rank=rank, world_size=world, local_rank=rank, local_world_size=world)
    init_process_group(info, torch.device("cpu"), "gloo", 60)
    seen = _train(_config(corpus, model_dir, method), info, world)  # the trainer is gone once it returns
    torch.save(seen, out / f"{method}-rank{rank}.pt")
    destroy_process_group()


@pytest.mark.parametrize("method", ["local_mix", "sbc"])
def test_validated_and_saved_model_is_identical_on_every_rank(method, tmp_path, reverse_corpus):
    model_dir = tmp_path / "model"
    mp.spawn(_worker, args=(2, free_port(), reverse_corpus, model_dir, method, tmp_path), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"{method}-rank{r}.pt", weights_only=False) for r in (0, 1))
    assert not torch.equal(r0["before"], r1["before"]), "the ranks' smoothed copies should have drifted"
    assert torch.equal(r0["params"], r1["params"])
    assert torch.equal(r0["ema"], r1["ema"])
    assert torch.allclose(r0["ema"], r0["rank_average"], atol=1e-7)

    saved = torch.load(model_dir / step_dir_name(PERIOD) / "model.pt", weights_only=True)["ema"]
    for span in r0["layout"]:
        expected = r0["rank_average"][span.offset : span.end].view(span.shape)
        assert torch.allclose(saved[span.name], expected, atol=1e-7), span.name
