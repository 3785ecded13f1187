"""Run one rank of a training job, synchronous or asynchronous, and turn every failure into one line.

The same for every rank and both trainers: threads, device, process group, the rank's body, and the exit-code
convention: 0 done; 1 the run itself failed (diverged); 2 a bad input (config, data, checkpoint, hardware);
`EXIT_PEER_LOST` (3) another process died or hung, which the local launcher turns into a line naming it;
130 interrupted. Every message is `nmt-train: error: rank R[ (role)]: ...` on stderr and, from the main
rank, at the end of its train.log.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

import torch

from nmt.config import Config, ConfigError
from nmt.data.corpus import CorpusError
from nmt.training.distributed import (
    EXIT_PEER_LOST,
    WorkerInfo,
    destroy_process_group,
    init_process_group,
    worker_info_from_env,
)
from nmt.training.errors import PeerFailure, TrainingDiverged, is_communication_error
from nmt.training.metrics import append_to_train_log
from nmt.training.precision import PrecisionError
from nmt.training.setup import select_device

RankBody = Callable[[Config, WorkerInfo, torch.device], None]


def report_failure(message: str, code: int = 2, model_dir: str | None = None) -> int:
    """One line on stderr (and, when `model_dir` is given and exists, at the end of its train.log)."""
    line = f"nmt-train: error: {message}"
    print(line, file=sys.stderr, flush=True)
    if model_dir:
        append_to_train_log(model_dir, line)
    return code


def run_rank(config: Config, body: RankBody, role: Callable[[WorkerInfo], str] | None = None) -> int:
    """Run `body` as this process's rank of the job; returns the exit code.

    `role` names a rank in messages (the asynchronous trainer's "parameter server" and "worker").
    """
    info = worker_info_from_env()
    who = f"rank {info.rank}" + (f" ({role(info)})" if role else "")
    resume = f"resume from the last checkpoint in {config.model_dir}"

    def fail(message: str, code: int = 2) -> int:
        return report_failure(f"{who}: {message}", code, config.model_dir if info.is_main else None)

    threads = config.train.threads or max(1, (os.cpu_count() or 1) // max(info.local_world_size, 1))
    torch.set_num_threads(threads)
    try:
        device = select_device(config, info)
        init_process_group(info, device, config.train.backend, config.train.collective_timeout_s)
        body(config, info, device)
    except PeerFailure as err:
        return fail(f"{err}; the job stops; {resume}", EXIT_PEER_LOST)
    except (CorpusError, FileNotFoundError, ConfigError, PrecisionError) as err:
        return fail(str(err))
    except TrainingDiverged as err:
        return fail(str(err), 1)
    except KeyboardInterrupt:
        return fail(f"interrupted; resume with the same command (checkpoints in {config.model_dir})", 130)
    except (OSError, RuntimeError) as err:
        if info.world_size > 1 and (isinstance(err, ConnectionError) or is_communication_error(err)):
            text = str(err).splitlines()[0] if str(err) else type(err).__name__
            return fail(
                f"a collective failed, so another process died or hung ({text}); the job stops; {resume}",
                EXIT_PEER_LOST,
            )
        if isinstance(err, OSError):  # a full disk or lost permissions while writing logs or outputs
            return fail(str(err))
        raise
    finally:
        destroy_process_group()
    return 0
