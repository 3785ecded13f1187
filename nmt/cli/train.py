"""`nmt-train --config FILE [key.path=value ...] [--workers N] [--dump-config]`.

Runs as one process, as N local workers it launches itself, or as one worker of a torchrun job
(single or multi-node: rank and world size come from the environment).

Every bad input is one line on stderr (`nmt-train: error: ...`, exit status 2) naming the file:line, the
override or the key, and it is found before any worker starts where it can be: the config, the hardware,
the data files (present, readable, non-empty, same line counts), the vocabulary, the model directory
(a writable directory, not in use by another job: see `acquire_model_dir_lock`) and a resume with another
number of workers (docs/reliability.md).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from compression.hierarchy import resolve_hierarchy
from compression.registry import is_asynchronous, job_processes
from nmt.checkpoint import (
    CheckpointError,
    ModelDirLock,
    acquire_model_dir_lock,
    check_world_size,
    find_resume_dir,
    load_inference_bundle,
    repair_last_link,
    step_checkpoints,
)
from nmt.cli.common import OneLineParser
from nmt.config import Config, ConfigError, dump_config, load_config, load_saved_config
from nmt.data.corpus import CorpusError, check_parallel_files
from nmt.evaluation import bleu_metric
from nmt.training.distributed import (
    WorkerInfo,
    launch_local_workers,
    launcher_gone,
    under_launcher,
    worker_info_from_env,
)
from nmt.training.init_from import apply_init_from
from nmt.training.metrics import tensorboard_problem
from nmt.training.precision import PrecisionError, require_runnable
from nmt.training.resume_options import check_resume_options
from nmt.training.runner import report_failure, run_rank

if TYPE_CHECKING:
    from nmt.training.trainer import Trainer


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
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
    parser.add_argument(
        "--allow-oversubscribe",
        action="store_true",
        help="allow more local CPU workers than CPU cores (refused by default: they would only slow down)",
    )
    parser.add_argument("--dump-config", action="store_true", help="print the effective config and exit")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # Intermixed: overrides may come before and after options (`--config R a=1 --workers 2 b=2`).
    args = build_parser().parse_intermixed_args(argv)
    local_worker = os.environ.get("NMT_LOCAL_LAUNCH") == "1" and under_launcher()
    if local_worker and launcher_gone():
        return 1  # our launcher died while we started: nobody is waiting for this worker
    if not args.config and not args.overrides:
        return report_failure(
            "no configuration: pass --config FILE (see recipes/) and/or key.path=value overrides"
        )
    try:
        # Renamed keys are reported once: by the launcher (or the single process), or by rank 0 (torchrun).
        config = load_config(
            args.config, args.overrides, warn_old_keys=not local_worker and worker_info_from_env().rank == 0
        )
    except ConfigError as err:
        return report_failure(str(err))
    if args.dump_config:
        sys.stdout.write(dump_config(config))
        return 0
    init_notes: list[str] = []
    try:
        apply_init_from(config, init_notes)  # train.init_from: same architecture, its vocabulary
    except ConfigError as err:
        return report_failure(str(err))
    if not local_worker and worker_info_from_env().rank == 0:
        for note in init_notes:
            print(note, file=sys.stderr)

    hardware_problem = _hardware_problem(config)
    if hardware_problem:
        return report_failure(hardware_problem)

    workers = args.workers if args.workers is not None else config.train.workers
    if workers < 1:
        return report_failure(f"--workers must be >= 1, got {workers}")

    # Checks before any worker starts: by the launcher (or the single process), or by rank 0 under torchrun.
    lock: ModelDirLock | None = None
    if not local_worker and worker_info_from_env().rank == 0:
        problem = ""
        if workers > _cpu_cores() and not under_launcher() and not args.allow_oversubscribe:
            problem = _oversubscribed(config, workers, args.workers is not None)
        problem = problem or _launch_problem(config) or _hierarchy_problem(config, workers)
        if problem:
            return report_failure(problem)
        try:
            lock = acquire_model_dir_lock(config.model_dir)
            notes = _check_resume(config, workers)
        except (CheckpointError, CorpusError) as err:
            if lock is not None:
                lock.release()
            return report_failure(str(err))
        for note in notes:
            print(note, file=sys.stderr)
    try:
        if is_asynchronous(config.exchange.method):  # dgs: N workers + 1 parameter server (docs/dgs.md)
            from nmt.training.dgs.entry import main_async

            return main_async(config, workers, _without_workers_flag(argv))
        if workers > 1 and not under_launcher():
            child_argv = _without_workers_flag(argv)
            return launch_local_workers(workers, child_argv)
        return run_worker(config)
    finally:
        if lock is not None:
            lock.release()


def _cpu_cores() -> int:
    """CPU cores this process may run on (its affinity mask, e.g. a container's or taskset's share)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _on_cpu(config: Config) -> bool:
    return config.train.device == "cpu" or not torch.cuda.is_available()


def _oversubscribed(config: Config, workers: int, from_flag: bool) -> str:
    """One line refusing more CPU workers than cores ("" when the workers run on GPUs)."""
    if not _on_cpu(config):
        return ""
    cores = _cpu_cores()
    why = "train.device is cpu" if torch.cuda.is_available() else "no CUDA"
    what = f"--workers {workers}" if from_flag else f"train.workers={workers}"
    return (
        f"{what} is more than the {cores} CPU core(s) of this machine ({why}): the workers would share cores "
        f"and train slower; use --workers {cores} or fewer, or pass --allow-oversubscribe to run anyway"
    )


def _launch_problem(config: Config) -> str:
    """One line for what would fail after the workers start: backend, data files, vocabulary, model_dir."""
    if config.train.backend == "nccl" and _on_cpu(config):
        return (
            "train.backend is 'nccl' but the workers run on CPU (NCCL needs CUDA); "
            "use train.backend=auto or gloo"
        )
    if config.train.tensorboard and tensorboard_problem():
        return tensorboard_problem()
    data = config.data
    pairs = [("data.train", data.train), ("data.valid", data.valid)]
    if config.valid.test_at_end and (data.test.src or data.test.tgt):
        pairs.append(("data.test", data.test))
    try:
        for key, files in pairs:
            check_parallel_files(files.src, files.tgt, key)
    except CorpusError as err:
        return str(err)
    if config.valid.translate or config.valid.test_at_end:
        try:
            bleu_metric(data.tgt_lang)  # fails now, not at the first validation, if its tokenizer is missing
        except RuntimeError as err:
            return f"data.tgt_lang: {err}"
    for key, value in (
        ("data.vocab.model", data.vocab.model),
        ("data.vocab.tgt_model", data.vocab.tgt_model),
    ):
        problem = _vocab_problem(key, value)
        if problem:
            return problem
    return _model_dir_problem(Path(config.model_dir))


def _hierarchy_problem(config: Config, workers: int) -> str:
    """One line for an exchange.hierarchy / node_size that this job's ranks cannot form (before launching)."""
    if is_asynchronous(config.exchange.method):
        return ""
    if under_launcher():
        info = worker_info_from_env()
        world, per_machine = info.world_size, info.local_world_size
    else:
        world = per_machine = workers
    try:
        resolve_hierarchy(config.exchange, world, per_machine)
    except ValueError as err:
        return str(err)
    return ""


def _vocab_problem(key: str, value: str) -> str:
    if not value:
        return ""
    path = Path(value)
    if path.exists():
        from nmt.data.vocab import Vocab

        try:
            Vocab.load(path)
        except CorpusError as err:
            return f"{key}: {err}"
        return ""
    if path.suffix != ".model":
        return (
            f"{key}: {path} does not exist, and a vocabulary nmt-train trains there needs a path ending in "
            f".model; rename it in the config"
        )
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    return _writable_problem(key, parent, "the vocabulary is trained into it")


def _model_dir_problem(model_dir: Path) -> str:
    if model_dir.exists() and not model_dir.is_dir():
        return (
            f"model_dir {model_dir} is an existing file, not a directory; set model_dir to a directory path"
        )
    try:
        model_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        return f"model_dir {model_dir}: cannot create it ({err.strerror}); set model_dir to a writable place"
    return _writable_problem("model_dir", model_dir, "checkpoints are written into it")


def _writable_problem(key: str, directory: Path, why: str) -> str:
    """'' if a file can be created in `directory` (tried for real: permission bits do not bind root)."""
    if not directory.is_dir():
        return f"{key}: {directory} is not a directory"
    try:
        fd, probe = tempfile.mkstemp(prefix=".nmt-write-test-", dir=directory)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        return f"{key}: {directory} is not writable ({err.strerror}); {why}: choose a writable directory"
    return ""


def _check_resume(config: Config, workers: int) -> list[str]:
    """Before launching: what a resume starts from, and whether it can (docs/reliability.md).

    A lost `last` link is rebuilt to the newest complete checkpoint (and said); another number of processes
    than wrote the checkpoint is refused; every changed option is applied (one line each) or refused
    (`nmt/training/resume_options.py`); a damaged `best` that the end-of-run test would read is refused now,
    not after the training. Returns the lines to print once every check has passed (an error is then the
    only line).
    """
    model_dir = Path(config.model_dir)
    if not config.train.resume:
        if not step_checkpoints(model_dir):
            return []
        return [
            f"nmt-train: train.resume=false: starting over in {model_dir}; its checkpoints are replaced as "
            f"the new run saves"
        ]
    notes = [repair_last_link(model_dir)]
    ckpt = find_resume_dir(model_dir)
    if ckpt is None:
        return []
    if under_launcher():
        world = worker_info_from_env().world_size
    else:
        world = job_processes(config.exchange.method, workers)
    check_world_size(ckpt, world, servers=job_processes(config.exchange.method, 0))
    try:
        saved = load_saved_config(ckpt / "config.yml")
    except ConfigError as err:
        raise CheckpointError(f"{ckpt / 'config.yml'}: cannot be read to resume ({err})") from None
    notes += check_resume_options(saved, config, model_dir)
    best = model_dir / "best"
    if config.valid.test_at_end and config.data.test.src and (best.is_symlink() or best.exists()):
        try:
            load_inference_bundle(best)
        except (CheckpointError, FileNotFoundError) as err:
            raise CheckpointError(
                f"{err}; the test at the end of training reads {best}: point it at another checkpoint "
                f"(ln -sfn step-N {best}) or remove the link"
            ) from None
    return [note for note in notes if note]


def _hardware_problem(config: Config) -> str:
    """One line when the config asks for hardware this machine lacks (checked before any worker starts)."""
    cuda = torch.cuda.is_available()
    if config.train.device == "cuda" and not cuda:
        return "train.device is 'cuda' but CUDA is not available; use train.device=auto or cpu"
    on_cuda = cuda and config.train.device != "cpu"
    try:
        require_runnable(config.train.precision, "cuda" if on_cuda else "cpu")
    except PrecisionError as err:
        return str(err)
    return ""


def _is_workers_flag(arg: str) -> bool:
    """`--workers`, or an abbreviation argparse accepts for it (`--work`); `--w` is already unambiguous."""
    name = arg.split("=", 1)[0]
    return name.startswith("--w") and "--workers".startswith(name)


def _without_workers_flag(argv: list[str]) -> list[str]:
    """The command line for the launched workers: the same, minus --workers N (wherever it is)."""
    out: list[str] = []
    skip_next = False
    for arg in argv:
        if skip_next:
            skip_next = False
        elif arg == "--":
            out.append(arg)
        elif _is_workers_flag(arg):
            skip_next = "=" not in arg
        else:
            out.append(arg)
    return out


def run_worker(config: Config) -> int:
    """Train as this process's rank of a synchronous job; returns the exit code."""
    return run_rank(config, fit_rank)


def fit_rank(
    config: Config, info: WorkerInfo, device: torch.device, prepare: Callable[[Trainer], None] | None = None
) -> None:
    """Build and run the trainer in a frame of its own, so that nothing holds it once training ends.

    `prepare` sees the built trainer before training starts (bench/drop_anatomy.py watches its exchange)."""
    from nmt.training.trainer import Trainer

    trainer = Trainer(config, info, device)
    try:
        if prepare is not None:
            prepare(trainer)
        trainer.fit()
    finally:
        trainer.close()


if __name__ == "__main__":
    sys.exit(main())
