"""`nmt-train --config FILE [key.path=value ...] [--workers N] [--dump-config]`.

Runs as one process, as N local workers it launches itself, or as one worker of a torchrun job
(single or multi-node: rank and world size come from the environment).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from nmt.config import Config, ConfigError, dump_config, load_config
from nmt.data.corpus import CorpusError
from nmt.training.distributed import (
    WorkerInfo,
    destroy_process_group,
    init_process_group,
    launch_local_workers,
    under_launcher,
    worker_info_from_env,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nmt-train",
        description="Train a translation model; one YAML config drives everything.",
        epilog="Example: nmt-train --config recipes/bible-es-en.yml --workers 2 train.max_steps=1000",
    )
    parser.add_argument("--config", "-c", help="YAML recipe (see recipes/)")
    parser.add_argument("overrides", nargs="*", help="key.path=value overrides, e.g. train.lr=3e-4")
    parser.add_argument(
        "--workers",
        type=int,
        default=None,
        help="local worker processes (default: train.workers); ignored under torchrun",
    )
    parser.add_argument("--dump-config", action="store_true", help="print the effective config and exit")
    return parser


def _fail(message: str, code: int = 2) -> int:
    print(f"nmt-train: error: {message}", file=sys.stderr, flush=True)
    return code


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if not args.config and not args.overrides:
        return _fail("no configuration: pass --config FILE (see recipes/) and/or key.path=value overrides")
    try:
        config = load_config(args.config, args.overrides)
    except ConfigError as err:
        return _fail(str(err))
    if args.dump_config:
        sys.stdout.write(dump_config(config))
        return 0

    workers = args.workers if args.workers is not None else config.train.workers
    if workers < 1:
        return _fail(f"--workers must be >= 1, got {workers}")
    if config.exchange.method == "dgs":  # asynchronous: N workers + 1 parameter server (docs/dgs.md)
        from nmt.training.async_trainer import main_async

        return main_async(config, workers, _without_workers_flag(argv))
    if workers > 1 and not under_launcher():
        child_argv = _without_workers_flag(argv)
        return launch_local_workers(workers, child_argv)
    return run_worker(config)


def _without_workers_flag(argv: list[str]) -> list[str]:
    """The command line for the launched workers: the same, minus --workers N."""
    out: list[str] = []
    skip_next = False
    for arg in argv:
        if skip_next:
            skip_next = False
        elif arg == "--workers":
            skip_next = True
        elif not arg.startswith("--workers="):
            out.append(arg)
    return out


def run_worker(config) -> int:
    """Train as this process's rank; returns the exit code."""
    from nmt.training.trainer import select_device

    info = worker_info_from_env()
    threads = config.train.threads or max(1, (os.cpu_count() or 1) // max(info.local_world_size, 1))
    torch.set_num_threads(threads)
    device = select_device(config, info)
    try:
        init_process_group(info, device, config.train.backend, config.train.collective_timeout_s)
        _fit(config, info, device)
    except (CorpusError, FileNotFoundError, ConfigError) as err:
        return _fail(f"rank {info.rank}: {err}")
    except KeyboardInterrupt:
        return _fail(
            f"rank {info.rank}: interrupted; resume with the same command (checkpoints in "
            f"{config.model_dir})",
            130,
        )
    except RuntimeError as err:
        text = str(err).splitlines()[0] if str(err) else type(err).__name__
        if info.world_size > 1 and _is_collective_failure(err):
            return _fail(
                f"rank {info.rank}: a collective failed, so another worker died or hung ({text}); "
                f"the job stops; resume from the last checkpoint in {config.model_dir}",
                1,
            )
        raise
    finally:
        destroy_process_group()
    return 0


def _fit(config: Config, info: WorkerInfo, device: torch.device) -> None:
    """Build and run the trainer in a frame of its own, so that nothing holds it once training ends."""
    from nmt.training.trainer import Trainer

    Trainer(config, info, device).fit()


def _is_collective_failure(err: BaseException) -> bool:
    text = str(err).lower()
    markers = ("gloo", "nccl", "connection", "timed out", "timeout", "peer", "broken pipe", "socket")
    return type(err).__name__ in ("DistBackendError", "DistNetworkError") or any(m in text for m in markers)


if __name__ == "__main__":
    sys.exit(main())
