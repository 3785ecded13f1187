"""Processes and files: workers die with their launcher, a model directory is locked by its job, leftovers of
killed runs are removed, a failed checkpoint write leaves nothing half-written; plus the real entry points."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

import nmt.checkpoint.writer as checkpoint_module
import nmt.cli.train as train_cli
from nmt.checkpoint import CheckpointWriter, find_resume_dir, load_inference_bundle
from nmt.config import config_from_dict
from nmt.data.config import VocabConfig
from nmt.data.vocab import load_or_train_vocabs

from reliability_helpers import ROOT, Env, alive, call_cli, children_of, run_module

linux_only = pytest.mark.skipif(
    not Path("/proc/self/stat").exists(), reason="reads processes from Linux /proc"
)

NO_EVAL = {"every": 0, "test_at_end": False, "translate": False}


def _long_job(env: Env, *args: str, log: Path) -> subprocess.Popen:
    """A real `nmt-train` that would train for hours: stopped by the test."""
    recipe = env.recipe(train__max_steps=1_000_000, valid=NO_EVAL)
    return subprocess.Popen(
        [sys.executable, "-m", "nmt.cli.train", "--config", str(recipe), *args],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=log.open("wb"),
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def _wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


@linux_only
def test_killing_the_launcher_ends_its_workers(env: Env):
    """SIGKILL to `nmt-train --workers 2` (no chance to clean up): its workers must not live on as orphans."""
    launcher = _long_job(env, "--workers", "2", log=env.tmp / "launcher.log")
    workers: list[int] = []
    try:
        _wait_for(lambda: len(children_of(launcher.pid)) == 2, 60, "2 workers")
        workers = children_of(launcher.pid)
        _wait_for(lambda: (env.model_dir / "config.yml").exists(), 90, "the workers to start training")
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(timeout=10)
        deadline = time.monotonic() + 20
        while any(alive(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.2)
        orphans = [pid for pid in workers if alive(pid)]
        assert not orphans, f"workers {orphans} outlived their launcher"
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        for pid in workers:  # only if the test failed: never leave our orphans behind
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


@linux_only
def test_a_second_job_on_a_model_dir_in_use_is_refused(env: Env, capsys):
    from nmt.checkpoint import acquire_model_dir_lock

    job = _long_job(env, log=env.tmp / "job.log")
    try:
        _wait_for(lambda: (env.model_dir / "config.yml").exists(), 90, "the first job to start training")
        holder = (env.model_dir / ".lock").read_text().split()
        assert holder[0] == str(job.pid)
        second = call_cli(
            train_cli.main, ["--config", str(env.recipe("second.yml", train__max_steps=1))], capsys
        )
        assert second.code == 2, second.err
        assert second.err_lines == [
            f"nmt-train: error: {env.model_dir} is in use by another training job (pid {job.pid} on host "
            f"{holder[1]}); wait for it or use another model_dir"
        ]
    finally:
        job.kill()
        job.wait()
    # The killed job left its .lock file behind, but no lock: the next job takes the directory over.
    assert (env.model_dir / ".lock").read_text().split()[0] == str(job.pid)
    with acquire_model_dir_lock(env.model_dir) as lock:
        assert (env.model_dir / ".lock").read_text().split()[0] == str(os.getpid())
        assert lock.fd is not None


def test_a_stale_lock_file_is_taken_over(tmp_path):
    from nmt.checkpoint import acquire_model_dir_lock

    (tmp_path / ".lock").write_text("999999999 gone-host\n")
    lock = acquire_model_dir_lock(tmp_path)
    try:
        assert (tmp_path / ".lock").read_text().split()[0] == str(os.getpid())
    finally:
        lock.release()
    acquire_model_dir_lock(tmp_path).release()  # released: free again


def test_checkpoint_leftovers_are_removed_when_the_next_run_starts(tmp_path):
    tmp = tmp_path / ".step-00000040.tmp"
    tmp.mkdir()
    (tmp / "state-rank0.pt").write_bytes(b"half")
    os.symlink("step-00000040", tmp_path / ".last.tmp")
    kept = tmp_path / "step-00000020"
    kept.mkdir()
    CheckpointWriter(tmp_path, rank=1, world_size=2, barrier=lambda: None)  # only the main rank cleans up
    assert tmp.exists()
    CheckpointWriter(tmp_path, rank=0, world_size=2, barrier=lambda: None)
    assert not tmp.exists() and not (tmp_path / ".last.tmp").is_symlink()
    assert kept.is_dir()


def test_vocabulary_leftovers_are_removed_where_vocabularies_are_trained(tmp_path, reverse_corpus):
    src, tgt = str(reverse_corpus / "train.src"), str(reverse_corpus / "train.tgt")
    stale = tmp_path / ".spm-k1ll3d"
    stale.mkdir()
    (stale / "sample.txt").write_text("left by a killed run\n")
    load_or_train_vocabs(VocabConfig(size=40), src, tgt, tmp_path)  # trains spm.model
    assert (tmp_path / "spm.model").is_file()
    assert not list(tmp_path.glob(".spm-*"))
    (tmp_path / ".spm-again").mkdir()  # and when the vocabulary already exists
    load_or_train_vocabs(VocabConfig(size=40), src, tgt, tmp_path)
    assert not list(tmp_path.glob(".spm-*"))


def test_a_failed_checkpoint_write_leaves_nothing_and_keeps_the_previous_one(env: Env, monkeypatch):
    from nmt.checkpoint import CheckpointError
    from nmt.data.vocab import Vocab

    model_dir = env.checkpoint()
    bundle = load_inference_bundle(model_dir)
    vocab = Vocab.load(bundle.path / "spm.model")
    writer = CheckpointWriter(model_dir, rank=0, world_size=1, barrier=lambda: None)
    config = config_from_dict({})
    real_write = checkpoint_module._write_torch

    def disk_full(obj, path):
        if Path(path).name == "model.pt":
            Path(path).write_bytes(b"partial")
            raise OSError(28, "No space left on device")
        return real_write(obj, path)

    monkeypatch.setattr(checkpoint_module, "_write_torch", disk_full)
    with pytest.raises(CheckpointError) as failure:
        writer.save(2, config, (vocab, vocab), bundle.state_dict, None, {}, {})
    message = str(failure.value)
    assert "\n" not in message
    assert "step-00000002 (No space left on device)" in message
    assert "the previous checkpoint (step-00000001) is intact" in message
    assert not list(model_dir.glob(".step-*")) and not (model_dir / "step-00000002").exists()
    assert find_resume_dir(model_dir).name == "step-00000001"
    monkeypatch.setattr(checkpoint_module, "_write_torch", real_write)
    assert load_inference_bundle(model_dir).path.name == "step-00000001"


@pytest.mark.skipif(not hasattr(resource, "RLIMIT_FSIZE"), reason="needs RLIMIT_FSIZE")
def test_a_full_disk_while_saving_is_one_line_and_leaves_no_temporary_checkpoint(env: Env, tmp_path):
    """A real run whose files may not grow past a limit (RLIMIT_FSIZE: writes fail like on a full disk)."""
    vocab = tmp_path / "vocab" / "spm.model"
    load_or_train_vocabs(
        VocabConfig(size=40, model=str(vocab)),
        *(str(env.corpus / f) for f in ("train.src", "train.tgt")),
        tmp_path,
    )
    limit = vocab.stat().st_size + (64 << 10)  # the vocabulary copy fits, the weights (~700 KB) do not
    recipe = env.recipe(train__max_steps=2, valid=NO_EVAL, data__vocab__model=str(vocab))

    def small_files() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    result = run_module("nmt.cli.train", "--config", str(recipe), preexec_fn=small_files)
    stderr = result.stderr.decode()
    assert result.returncode == 2, stderr
    assert "Traceback" not in stderr
    errors = [line for line in stderr.splitlines() if line.startswith("nmt-train: error:")]
    assert len(errors) == 1, stderr
    assert f"cannot write checkpoint {env.model_dir / 'step-00000002'}" in errors[0]
    assert not list(env.model_dir.glob(".step-*")) and not (env.model_dir / "step-00000002").exists()


# ------------------------------------------------------------------------------------------ command line


def test_overrides_on_both_sides_of_workers_are_accepted(env: Env, capsys):
    argv = [
        "--config",
        str(env.recipe()),
        "train.lr=0.01",
        "--workers",
        "2",
        "train.max_steps=7",
        "--dump-config",
    ]
    result = call_cli(train_cli.main, argv, capsys)
    assert result.code == 0, result.err
    dumped = yaml.safe_load(result.out)
    assert dumped["train"]["lr"] == 0.01 and dumped["train"]["max_steps"] == 7


@pytest.mark.parametrize(
    "argv",
    [
        ["--config", "R", "a=1", "--workers", "2", "b=2"],
        ["--config", "R", "a=1", "--workers=2", "b=2"],
        ["--workers", "2", "--config", "R", "a=1", "b=2"],
        ["--config", "R", "a=1", "--work", "2", "b=2"],
    ],
)
def test_the_workers_command_line_has_no_workers_flag(argv):
    assert train_cli._without_workers_flag(argv) == ["--config", "R", "a=1", "b=2"]


def test_allow_oversubscribe_lets_more_workers_than_cores_pass_the_check(env: Env, capsys, monkeypatch):
    monkeypatch.setattr(train_cli, "_cpu_cores", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    launched = {}

    def fake_launch(n, argv):
        launched.update(n=n, argv=argv)
        return 0

    monkeypatch.setattr(train_cli, "launch_local_workers", fake_launch)
    argv = ["--config", str(env.recipe()), "--workers", "2", "--allow-oversubscribe", "train.max_steps=3"]
    assert call_cli(train_cli.main, argv, capsys).code == 0
    assert (
        launched["n"] == 2 and "--workers" not in launched["argv"] and "train.max_steps=3" in launched["argv"]
    )


def test_dgs_is_a_valid_asynchronous_method_and_its_requirements_are_checked_on_loading(env: Env, capsys):
    argv = ["--config", str(env.recipe()), "exchange.method=dgs", "train.optimizer=sgd", "--dump-config"]
    result = call_cli(train_cli.main, argv, capsys)
    assert result.code == 0, result.err
    assert yaml.safe_load(result.out)["exchange"]["method"] == "dgs"
    adam = call_cli(train_cli.main, argv[:-2] + ["--dump-config"], capsys)  # the tiny recipe's Adam
    assert adam.code == 2 and len(adam.err_lines) == 1, adam.err
    assert adam.err_lines[0].startswith(
        "nmt-train: error: override exchange.method=dgs: exchange.method dgs trains with SAMomentum"
    )


# ------------------------------------------------------------------------------------------ real entry points


def _one_error_line(result: subprocess.CompletedProcess, prog: str) -> str:
    stderr = result.stderr.decode()
    assert result.returncode == 2, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), stderr
    return lines[0]


def test_real_nmt_train_bad_override(env: Env):
    recipe = env.recipe()
    result = run_module("nmt.cli.train", "--config", str(recipe), "model.heads=0", "--dump-config")
    line = _one_error_line(result, "nmt-train")
    assert "override model.heads=0: model.heads must be >= 1" in line and str(recipe) not in line


def test_real_nmt_translate_truncated_model(env: Env):
    weights = env.step_dir() / "model.pt"
    weights.write_bytes(weights.read_bytes()[:1000])
    result = run_module("nmt.cli.translate", "--model", str(env.checkpoint()), stdin=b"alpha beta\n")
    assert f"{weights}: cannot be read" in _one_error_line(result, "nmt-translate")


def test_real_nmt_translate_stdin_not_utf8(env: Env):
    result = run_module("nmt.cli.translate", "--model", str(env.checkpoint()), stdin=b"alpha\nbeta\n\xe9\n")
    assert "stdin:3: not UTF-8 text" in _one_error_line(result, "nmt-translate")
