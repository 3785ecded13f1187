"""The bad-input table: every case must end with exit status 2 and exactly ONE line on stderr that names the
file (and line), the override, the key or the flag at fault, without a traceback.

Cases run the real `main` of `nmt-train` / `nmt-translate` in this process (fast: nothing trains; every
failure here happens before any worker would start). A few of them also run as real subprocesses in
test_reliability_processes.py. The groups and cases are listed in docs/reliability.md.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch

import nmt.cli.train as train_cli
import nmt.cli.translate as translate_cli

from reliability_helpers import Env, call_cli, line_of, unwritable_dir


@dataclass
class Spec:
    argv: list[str]
    expect: list[str]  # each must appear in the one stderr line
    absent: list[str] = field(default_factory=list)  # none may appear in it
    stdin: bytes = b""


@dataclass
class Case:
    group: str
    name: str
    tool: str  # "train" | "translate"
    setup: Callable[[Env], Spec]

    @property
    def id(self) -> str:
        return f"{self.group}/{self.name}"


CASES: list[Case] = []


def case(group: str, name: str, tool: str = "train"):
    def register(setup: Callable[[Env], Spec]) -> Callable[[Env], Spec]:
        CASES.append(Case(group, name, tool, setup))
        return setup

    return register


def at(path, key: str) -> str:
    return f"{path}:{line_of(path, key)}: "


# ------------------------------------------------------------------------------------------ config file


@case("config-file", "missing")
def _(env: Env) -> Spec:
    path = env.tmp / "nope.yml"
    return Spec(["--config", str(path)], ["config file not found", str(path)])


@case("config-file", "is-a-directory")
def _(env: Env) -> Spec:
    return Spec(["--config", str(env.tmp)], [f"--config {env.tmp} is a directory"])


@case("config-file", "not-utf8")
def _(env: Env) -> Spec:
    path = env.file("latin1.yml", b"train:\n  lr: 0.1 # caf\xe9\n")
    return Spec(["--config", str(path)], [str(path), "not UTF-8"])


@case("config-file", "invalid-yaml")
def _(env: Env) -> Spec:
    path = env.recipe(text="train:\n  lr: 1\n   bad: [\n")
    return Spec(["--config", str(path)], [f"{path}:3: invalid YAML"])


@case("config-file", "tab-indentation")
def _(env: Env) -> Spec:
    path = env.recipe(text="train:\n\tlr: 1\n")
    return Spec(["--config", str(path)], [f"{path}:2: invalid YAML"])


@case("config-file", "top-level-list")
def _(env: Env) -> Spec:
    path = env.recipe(text="- train\n- model\n")
    return Spec(["--config", str(path)], [str(path), "top level must be a mapping"])


@case("config-file", "duplicate-key")
def _(env: Env) -> Spec:
    path = env.recipe(text="train:\n  lr: 0.1\n  lr: 0.2\n")
    return Spec(["--config", str(path)], [f"{path}:3: duplicate key 'train.lr' (first at line 2)"])


@case("config-file", "unknown-section")
def _(env: Env) -> Spec:
    path = env.recipe(text="trian:\n  lr: 1\n")
    return Spec(["--config", str(path)], [f"{path}:1: unknown key 'trian'", "did you mean 'train'"])


UNKNOWN_KEYS = [  # (typo, what the suggestion must name)
    ("model_dri", "model_dir"),
    ("data.max_lne", "data.max_len"),
    ("data.train.source", ""),
    ("data.vocab.sise", "data.vocab.size"),
    ("model.head", "model.heads"),
    ("train.warmup_step", "train.warmup_steps"),
    ("valid.evrey", "valid.every"),
    ("decode.beam", "decode.beam_size"),
    ("exchange.drop_ration", "exchange.drop_ratio"),
]

for _typo, _near in UNKNOWN_KEYS:

    def _unknown(env: Env, typo: str = _typo, near: str = _near) -> Spec:
        path = env.recipe(**{typo.replace(".", "__"): 1})
        expect = [f"{at(path, typo)}unknown key '{typo}'"] + ([f"did you mean '{near}'"] if near else [])
        return Spec(["--config", str(path)], expect)

    case("config-file", f"unknown-key-{_typo}")(_unknown)


FILE_VALUES = [  # (key, bad value in the file, text of the message)
    ("train", 5, "train: expected a section (mapping), got 5"),
    ("train.max_steps", "many", "train.max_steps: expected an integer, got 'many'"),
    ("train.max_steps", 2.5, "train.max_steps: expected an integer, got 2.5"),
    ("train.max_steps", float("inf"), "train.max_steps: expected an integer, got inf"),
    ("train.lr", float("nan"), "train.lr: expected a finite number, got nan"),
    ("train.resume", "maybe", "train.resume: expected true or false, got 'maybe'"),
    ("valid.metrics", {"bleu": 1}, "valid.metrics: expected a list"),
    ("model_dir", ["a", "b"], "model_dir: expected a string"),
    ("model.preset", "huge", "model.preset: unknown preset 'huge' (available: tiny, base, big, s2s)"),
    ("train.lr", -1, "train.lr must be > 0, got -1.0"),
    ("train.max_steps", -5, "train.max_steps must be >= 0 (0 = no limit), got -5"),
    ("exchange.method", "locl_mix", "exchange.method: unknown method 'locl_mix'; did you mean 'local_mix'?"),
    ("model_dir", "", "model_dir must not be empty"),
]

for _key, _value, _text in FILE_VALUES:

    def _file_value(env: Env, key: str = _key, value: object = _value, text: str = _text) -> Spec:
        path = env.recipe(**{key.replace(".", "__"): value})
        return Spec(["--config", str(path), "--dump-config"], [f"{at(path, key)}{text}"])

    case("config-file", f"value-{_key}={_value!r}")(_file_value)


# ------------------------------------------------------------------------------------------ overrides


OVERRIDES = [  # (override, text of the message)
    ("train.lr", "override 'train.lr': expected key.path=value"),
    ("=3", "override '=3': empty key"),
    ("train..lr=1", "override 'train..lr=1': empty key"),
    ("train.lrr=1", "override train.lrr=1: unknown key 'train.lrr'; did you mean 'train.lr'?"),
    ("trainn.lr=1", "override trainn.lr=1: unknown key 'trainn'; did you mean 'train'?"),
    ("train.lr=abc", "override train.lr=abc: train.lr: expected a number, got 'abc'"),
    ("train.lr=-1", "override train.lr=-1: train.lr must be > 0"),
    ("train.max_steps=ten", "override train.max_steps=ten: train.max_steps: expected an integer, got 'ten'"),
    ("train=5", "override train=5: train: expected a section (mapping), got 5"),
    ("model.heads=3", "override model.heads=3: model.d_model (64) must be divisible by model.heads (3)"),
    ("data.vocab.type=word", "override data.vocab.type=word: data.vocab.type must be 'unigram' or 'bpe'"),
]

for _override, _text in OVERRIDES:

    def _bad_override(env: Env, override: str = _override, text: str = _text) -> Spec:
        path = env.recipe()
        # the override is at fault, not the recipe: the recipe's name must not be blamed
        return Spec(["--config", str(path), override, "--dump-config"], [text], absent=[str(path)])

    case("overrides", _override)(_bad_override)


@case("overrides", "without-recipe")
def _(env: Env) -> Spec:
    return Spec(["train.lr=abc"], ["override train.lr=abc: train.lr: expected a number"])


@case("overrides", "later-override-is-blamed")
def _(env: Env) -> Spec:
    path = env.recipe()
    argv = ["--config", str(path), "train.lr=0.1", "train.lr=-2", "--dump-config"]
    return Spec(argv, ["override train.lr=-2: train.lr must be > 0"], absent=["train.lr=0.1"])


# ------------------------------------------------------------------------------------------ exchange


EXCHANGE = [
    (
        "exchange.method=foo",
        "override exchange.method=foo: exchange.method: unknown method 'foo' (available: ",
    ),
    ("exchange.method=dropin", "did you mean 'dropping'?"),
    ("exchange.sbc.preset=delay-1000", "exchange.sbc.preset: unknown SBC preset 'delay-1000'"),
    ("exchange.sbc.selection=top", "exchange.sbc.selection must be 'per_sign' or 'magnitude'"),
    ("exchange.drop_ratio=1.5", "exchange.drop_ratio must be in [0, 1)"),
    ("exchange.quantize_bits=3", "exchange.quantize_bits must be 0, 1 or 2"),
    ("exchange.local_mix.average_every=0", "exchange.local_mix.average_every must be >= 1"),
    (
        "exchange.sbc.delay=5",
        "override exchange.sbc.delay=5: exchange.sbc.delay is set but exchange.method is 'dense'; it only "
        "applies to method sbc: remove it or set exchange.method=sbc",
    ),
]

for _override, _text in EXCHANGE:

    def _exchange(env: Env, override: str = _override, text: str = _text) -> Spec:
        return Spec(["--config", str(env.recipe()), override, "--dump-config"], [text])

    case("exchange", _override)(_exchange)


@case("exchange", "method-lists-every-method")
def _(env: Env) -> Spec:
    from compression import available_methods

    names = available_methods()
    assert "dgs" in names  # the asynchronous method is registered too
    return Spec(["--config", str(env.recipe()), "exchange.method=x", "--dump-config"], names)


# ------------------------------------------------------------------------------------------ model sizes


MODEL = [
    ("model.heads=0", "model.heads must be >= 1, got 0"),
    ("model.d_model=0", "model.d_model must be >= 1, got 0"),
    ("model.ffn_dim=0", "model.ffn_dim must be >= 1, got 0"),
    ("model.encoder_layers=0", "model.encoder_layers must be >= 1, got 0"),
    ("model.decoder_layers=-1", "model.decoder_layers must be >= 1, got -1"),
    ("model.max_positions=0", "model.max_positions must be >= 1, got 0"),
    ("model.rnn_hidden=0", "model.rnn_hidden must be >= 1, got 0"),
    ("model.rnn_embed=-4", "model.rnn_embed must be >= 1, got -4"),
    ("model.dropout=1", "model.dropout must be in [0, 1)"),
    ("model.attention_dropout=1.5", "model.attention_dropout must be in [0, 1)"),
    ("model.arch=cnn", "model.arch must be 'transformer' or 'rnn'"),
]

for _override, _text in MODEL:

    def _model(env: Env, override: str = _override, text: str = _text) -> Spec:
        return Spec(
            ["--config", str(env.recipe()), override, "--dump-config"], [f"override {override}: {text}"]
        )

    case("model-sizes", _override)(_model)


@case("model-sizes", "rnn-hidden-0-with-arch-rnn")
def _(env: Env) -> Spec:
    argv = ["--config", str(env.recipe()), "model.arch=rnn", "model.rnn_hidden=0", "--dump-config"]
    return Spec(argv, ["override model.rnn_hidden=0: model.rnn_hidden must be >= 1"])


# ------------------------------------------------------------------------------------------ signs


SIGNS = [  # every int/float option of train, valid, data, decode where a negative value means nothing
    "train.max_steps=-5",
    "train.save_every=-1",
    "train.max_epochs=-1",
    "train.max_wall_s=-1",
    "train.max_train_s=-1",
    "train.warmup_steps=-1",
    "train.threads=-2",
    "train.clip_norm=-1",
    "train.weight_decay=-0.1",
    "train.adam_eps=-1e-9",
    "train.momentum=-0.5",
    "train.label_smoothing=-0.1",
    "train.log_every=0",
    "train.keep_checkpoints=0",
    "train.optimizer_delay=0",
    "train.straggler_ms=-1",
    "train.collective_timeout_s=0",
    "train.workers=0",
    "valid.every=-1",
    "valid.every_train_s=-1",
    "valid.max_sentences=-1",
    "valid.beam_size=-1",
    "valid.early_stopping=-1",
    "data.max_len=-1",
    "data.batch_tokens=-1",
    "data.buffer_sentences=0",
    "data.vocab.size=-1",
    "data.vocab.train_sentences=0",
    "decode.beam_size=0",
    "decode.n_best=0",
    "decode.max_len_factor=-1",
    "decode.max_len_b=-1",
    "decode.length_penalty=-1",
    "decode.batch_sentences=0",
    "decode.max_input_tokens=-1",
    "seed=-1",
]

for _override in SIGNS:

    def _sign(env: Env, override: str = _override) -> Spec:
        key = override.split("=")[0]
        return Spec(
            ["--config", str(env.recipe()), override, "--dump-config"], [f"override {override}: {key}"]
        )

    case("signs", _override)(_sign)


# ------------------------------------------------------------------------------------------ command line


@case("cli", "no-configuration")
def _(env: Env) -> Spec:
    return Spec([], ["no configuration: pass --config FILE"])


@case("cli", "workers-zero")
def _(env: Env) -> Spec:
    return Spec(["--config", str(env.recipe()), "--workers", "0"], ["--workers must be >= 1, got 0"])


@case("cli", "workers-not-a-number")
def _(env: Env) -> Spec:
    return Spec(
        ["--config", str(env.recipe()), "--workers", "two"], ["--workers", "invalid int value: 'two'"]
    )


@case("cli", "unknown-flag")
def _(env: Env) -> Spec:
    return Spec(["--config", str(env.recipe()), "--wrokers", "2"], ["unrecognized arguments: --wrokers"])


def _cpu_only(env: Env, cores: int = 2) -> None:
    env.patches += [("nmt.cli.train._cpu_cores", lambda: cores), ("torch.cuda.is_available", lambda: False)]


@case("cli", "more-workers-than-cores")
def _(env: Env) -> Spec:
    _cpu_only(env)
    argv = ["--config", str(env.recipe()), "--workers", "3"]
    return Spec(argv, ["--workers 3 is more than the 2 CPU core(s)", "no CUDA", "--allow-oversubscribe"])


@case("cli", "more-workers-than-cores-from-config")
def _(env: Env) -> Spec:
    _cpu_only(env)
    return Spec(["--config", str(env.recipe(train__workers=5))], ["train.workers=5 is more than the 2 CPU"])


@case("cli", "nccl-on-cpu")
def _(env: Env) -> Spec:
    argv = ["--config", str(env.recipe()), "train.device=cpu", "train.backend=nccl"]
    return Spec(argv, ["train.backend is 'nccl' but the workers run on CPU"])


@case("cli", "cuda-device-without-cuda")
def _(env: Env) -> Spec:
    _cpu_only(env)
    return Spec(["--config", str(env.recipe()), "train.device=cuda"], ["train.device is 'cuda'"])


@case("cli", "fp16-without-cuda")
def _(env: Env) -> Spec:
    _cpu_only(env)
    return Spec(["--config", str(env.recipe()), "train.precision=fp16"], ["train.precision=fp16 needs CUDA"])


# ------------------------------------------------------------------------------------------ data files


def _lines(env: Env, split: str, side: str) -> list[str]:
    return (env.corpus / f"{split}.{side}").read_text(encoding="utf-8").splitlines()


@case("data", "train-src-missing")
def _(env: Env) -> Spec:
    missing = env.tmp / "nope.src"
    argv = ["--config", str(env.recipe()), f"data.train.src={missing}"]
    return Spec(argv, [f"data.train.src: {missing}: file not found"])


@case("data", "train-tgt-empty")
def _(env: Env) -> Spec:
    empty = env.file("empty.tgt", b"")
    return Spec(
        ["--config", str(env.recipe(data__train__tgt=str(empty)))],
        [f"data.train.tgt: {empty}: file is empty"],
    )


@case("data", "train-src-is-a-directory")
def _(env: Env) -> Spec:
    argv = ["--config", str(env.recipe()), f"data.train.src={env.tmp}"]
    return Spec(argv, [f"data.train.src: {env.tmp}: is a directory"])


@case("data", "train-line-counts-differ")
def _(env: Env) -> Spec:
    short = env.file("short.tgt", "\n".join(_lines(env, "train", "tgt")[:-1]) + "\n")
    argv = ["--config", str(env.recipe()), f"data.train.tgt={short}"]
    return Spec(argv, ["data.train: ", "has 2000 lines but", f"{short} has 1999"])


@case("data", "train-not-gzip")
def _(env: Env) -> Spec:
    fake = env.file("train.src.gz", "not gzip\n")
    argv = ["--config", str(env.recipe()), f"data.train.src={fake}"]
    return Spec(argv, [f"data.train.src: {fake}: not a valid gzip file"])


@case("data", "valid-not-set")
def _(env: Env) -> Spec:
    return Spec(["--config", str(env.recipe()), "data.valid.src="], ["data.valid.src is not set"])


@case("data", "valid-line-counts-differ")
def _(env: Env) -> Spec:
    longer = env.file("long.tgt", "\n".join(_lines(env, "dev", "tgt") + ["one more"]) + "\n")
    argv = ["--config", str(env.recipe()), f"data.valid.tgt={longer}"]
    return Spec(argv, ["data.valid: ", "has 40 lines but", f"{longer} has 41"])


@case("data", "test-line-counts-differ")
def _(env: Env) -> Spec:
    short = env.file("short.src", "\n".join(_lines(env, "test", "src")[:10]) + "\n")
    argv = ["--config", str(env.recipe()), f"data.test.src={short}"]
    return Spec(argv, ["data.test: ", f"{short} has 10 lines but"])


@case("data", "vocab-model-not-sentencepiece")
def _(env: Env) -> Spec:
    garbage = env.file("garbage.model", b"\x00\x01 not a model")
    argv = ["--config", str(env.recipe()), f"data.vocab.model={garbage}"]
    return Spec(argv, [f"data.vocab.model: {garbage}: not a sentencepiece model"])


@case("data", "vocab-tgt-model-not-sentencepiece")
def _(env: Env) -> Spec:
    garbage = env.file("garbage.model", b"\x00\x01 not a model")
    argv = ["--config", str(env.recipe()), "model.tie_embeddings=decoder", f"data.vocab.tgt_model={garbage}"]
    return Spec(argv, [f"data.vocab.tgt_model: {garbage}: not a sentencepiece model"])


@case("data", "vocab-model-wrong-suffix")
def _(env: Env) -> Spec:
    path = env.tmp / "vocab.txt"
    argv = ["--config", str(env.recipe()), f"data.vocab.model={path}"]
    return Spec(argv, [f"data.vocab.model: {path} does not exist", "ending in .model"])


@case("data", "vocab-model-in-unwritable-directory")
def _(env: Env) -> Spec:
    locked = unwritable_dir(env.tmp)
    if locked is None:
        pytest.skip("no unwritable directory on this machine")
    argv = ["--config", str(env.recipe()), f"data.vocab.model={locked / 'spm.model'}"]
    return Spec(argv, [f"data.vocab.model: {locked} is not writable"])


# ------------------------------------------------------------------------------------------ model_dir


@case("model-dir", "is-a-file")
def _(env: Env) -> Spec:
    path = env.file("model-file", "x")
    argv = ["--config", str(env.recipe()), f"model_dir={path}"]
    return Spec(argv, [f"model_dir {path} is an existing file, not a directory"])


@case("model-dir", "not-writable")
def _(env: Env) -> Spec:
    locked = unwritable_dir(env.tmp)
    if locked is None:
        pytest.skip("no unwritable directory on this machine")
    argv = ["--config", str(env.recipe()), f"model_dir={locked}"]
    return Spec(argv, [f"model_dir: {locked} is not writable"])


@case("model-dir", "below-a-file")
def _(env: Env) -> Spec:
    path = env.file("afile", "x") / "model"
    argv = ["--config", str(env.recipe()), f"model_dir={path}"]
    return Spec(argv, [f"model_dir {path}: cannot create it"])


@case("model-dir", "locked-by-another-job")
def _(env: Env) -> Spec:
    env.model_dir.mkdir()
    fd = os.open(env.model_dir / ".lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # what another live job holds (another process in reality)
    os.write(fd, b"4242 otherhost\n")
    env.patches.append(("_held_fd", fd))
    return Spec(
        ["--config", str(env.recipe()), "train.max_steps=1"],
        [
            f"{env.model_dir} is in use by another training job (pid 4242 on host otherhost)",
            "another model_dir",
        ],
    )


def _fake_checkpoint(env: Env, meta: str) -> None:
    step = env.model_dir / "step-00000005"
    step.mkdir(parents=True)
    (step / "meta.json").write_text(meta, encoding="utf-8")
    os.symlink(step.name, env.model_dir / "last")


@case("model-dir", "resume-with-other-worker-count")
def _(env: Env) -> Spec:
    _fake_checkpoint(env, '{"step": 5, "world_size": 2}')
    argv = ["--config", str(env.recipe()), "train.max_steps=1"]
    return Spec(argv, ["step-00000005: checkpoint was written by 2 workers but this run has 1"])


def _checkpoint_of_the_base_recipe(env: Env) -> None:
    from nmt.config import config_from_dict, save_config

    _fake_checkpoint(env, '{"step": 5, "world_size": 1}')
    save_config(config_from_dict(env.base), env.model_dir / "step-00000005" / "config.yml")


@case("model-dir", "resume-with-other-model-size")
def _(env: Env) -> Spec:
    _checkpoint_of_the_base_recipe(env)
    argv = ["--config", str(env.recipe()), "model.d_model=128"]
    return Spec(argv, ["model.d_model is 128 but", "was trained with 64", "use another model_dir"])


@case("model-dir", "resume-with-other-vocab-size")
def _(env: Env) -> Spec:
    _checkpoint_of_the_base_recipe(env)
    argv = ["--config", str(env.recipe()), "data.vocab.size=80"]
    return Spec(argv, ["data.vocab.size is 80 but", "was trained with 40"])


@case("model-dir", "resume-from-broken-meta")
def _(env: Env) -> Spec:
    _fake_checkpoint(env, '{"step": 5, "world_si')
    argv = ["--config", str(env.recipe()), "train.max_steps=1"]
    return Spec(argv, ["step-00000005/meta.json: cannot be read", "ln -sfn step-N last"])


# ------------------------------------------------------------------------------------------ nmt-translate


@case("translate", "model-missing", "translate")
def _(env: Env) -> Spec:
    return Spec(
        ["--model", str(env.tmp / "nope")], [f"--model {env.tmp / 'nope'}: no such checkpoint directory"]
    )


@case("translate", "model-is-a-file", "translate")
def _(env: Env) -> Spec:
    path = env.file("model.txt", "x")
    return Spec(["--model", str(path)], [f"--model {path}: not a directory"])


@case("translate", "model-dir-without-checkpoint", "translate")
def _(env: Env) -> Spec:
    return Spec(["--model", str(env.tmp)], [f"{env.tmp}: no checkpoint here"])


@case("translate", "model-pt-truncated", "translate")
def _(env: Env) -> Spec:
    weights = env.step_dir() / "model.pt"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    return Spec(["--model", str(env.checkpoint())], [f"{weights}: cannot be read", "truncated"])


@case("translate", "model-pt-garbage", "translate")
def _(env: Env) -> Spec:
    weights = env.step_dir() / "model.pt"
    weights.write_bytes(os.urandom(4096))
    return Spec(["--model", str(env.checkpoint())], [f"{weights}: cannot be read"])


@case("translate", "model-pt-empty", "translate")
def _(env: Env) -> Spec:
    weights = env.step_dir() / "model.pt"
    weights.write_bytes(b"")
    return Spec(["--model", str(env.checkpoint())], [f"{weights}: cannot be read"])


@case("translate", "model-pt-missing", "translate")
def _(env: Env) -> Spec:
    (env.step_dir() / "model.pt").unlink()
    return Spec(
        ["--model", str(env.step_dir())], [f"{env.step_dir()}: no checkpoint here (expected model.pt"]
    )


@case("translate", "model-pt-not-weights", "translate")
def _(env: Env) -> Spec:
    weights = env.step_dir() / "model.pt"
    torch.save({"something": torch.zeros(2)}, weights)
    return Spec(["--model", str(env.checkpoint())], [f"{weights}: not a model checkpoint"])


def _poison(env: Env, value: float) -> None:
    weights = env.step_dir() / "model.pt"
    state = torch.load(weights, weights_only=True)
    name = sorted(state["model"])[0]
    state["model"][name].view(-1)[0] = value
    torch.save(state, weights)


@case("translate", "weights-nan", "translate")
def _(env: Env) -> Spec:
    _poison(env, float("nan"))
    weights = env.step_dir() / "model.pt"
    expect = [
        f"{weights} holds non-finite weights (NaN/inf): the run that wrote it diverged",
        "earlier checkpoint",
    ]
    return Spec(["--model", str(env.checkpoint())], expect)


@case("translate", "weights-inf", "translate")
def _(env: Env) -> Spec:
    _poison(env, float("inf"))
    return Spec(["--model", str(env.checkpoint())], ["model.pt holds non-finite weights (NaN/inf)"])


@case("translate", "checkpoint-config-broken", "translate")
def _(env: Env) -> Spec:
    (env.step_dir() / "config.yml").write_text("model: [\n", encoding="utf-8")
    return Spec(["--model", str(env.checkpoint())], [f"{env.step_dir() / 'config.yml'}:", "invalid YAML"])


@case("translate", "checkpoint-vocab-json-missing", "translate")
def _(env: Env) -> Spec:
    (env.step_dir() / "vocab.json").unlink()
    return Spec(["--model", str(env.checkpoint())], [f"{env.step_dir() / 'vocab.json'}: missing"])


@case("translate", "checkpoint-spm-missing", "translate")
def _(env: Env) -> Spec:
    (env.step_dir() / "spm.model").unlink()
    return Spec(
        ["--model", str(env.checkpoint())], [f"{env.step_dir() / 'spm.model'}: sentencepiece model not found"]
    )


@case("translate", "weights-do-not-fit-config", "translate")
def _(env: Env) -> Spec:
    config = env.step_dir() / "config.yml"
    config.write_text(
        config.read_text(encoding="utf-8").replace("d_model: 64", "d_model: 32"), encoding="utf-8"
    )
    return Spec(["--model", str(env.checkpoint())], ["the weights do not fit the model"])


def _input(env: Env, data: bytes) -> str:
    return str(env.file("input.txt", data))


@case("translate", "input-not-utf8", "translate")
def _(env: Env) -> Spec:
    path = _input(env, b"alpha beta\ngamma\ndelta caf\xe9 beta\nalpha\n")
    argv = ["--model", str(env.checkpoint()), "--input", path]
    return Spec(argv, [f"--input {path}:3: not UTF-8 text", "iconv"])


@case("translate", "stdin-not-utf8", "translate")
def _(env: Env) -> Spec:
    return Spec(
        ["--model", str(env.checkpoint())], ["stdin:2: not UTF-8 text"], stdin=b"alpha\n\xff\xfe beta\n"
    )


@case("translate", "input-missing", "translate")
def _(env: Env) -> Spec:
    missing = env.tmp / "nope.txt"
    return Spec(
        ["--model", str(env.checkpoint()), "--input", str(missing)], [f"--input {missing}: no such file"]
    )


@case("translate", "input-is-a-directory", "translate")
def _(env: Env) -> Spec:
    return Spec(
        ["--model", str(env.checkpoint()), "--input", str(env.tmp)], [f"--input {env.tmp}: is a directory"]
    )


@case("translate", "output-in-missing-directory", "translate")
def _(env: Env) -> Spec:
    out = env.tmp / "no" / "such" / "out.txt"
    return Spec(
        ["--model", str(env.checkpoint()), "--output", str(out)], [f"--output {out}: cannot write it"]
    )


@case("translate", "output-not-writable", "translate")
def _(env: Env) -> Spec:
    locked = unwritable_dir(env.tmp)
    if locked is None:
        pytest.skip("no unwritable directory on this machine")
    out = locked / "out.txt"
    return Spec(
        ["--model", str(env.checkpoint()), "--output", str(out)], [f"--output {out}: cannot write it"]
    )


@case("translate", "output-is-a-directory", "translate")
def _(env: Env) -> Spec:
    argv = ["--model", str(env.checkpoint()), "--output", str(env.tmp)]
    return Spec(argv, [f"--output {env.tmp}: cannot write it (Is a directory)"])


@case("translate", "output-is-the-input", "translate")
def _(env: Env) -> Spec:
    path = _input(env, b"alpha beta\n")
    argv = ["--model", str(env.checkpoint()), "--input", path, "--output", path]
    return Spec(argv, [f"--output {path} is the --input file"])


FLAGS = [
    (["--beam-size", "0"], "--beam-size 0: decode.beam_size must be >= 1"),
    (["--n-best", "0"], "--n-best 0: decode.n_best must be in [1"),
    (["--max-input-tokens", "-1"], "--max-input-tokens -1: decode.max_input_tokens must be >= 0"),
    (["--max-len-factor", "0"], "--max-len-factor 0.0: decode.max_len_factor must be > 0"),
    (["--length-penalty", "-1"], "--length-penalty -1.0: decode.length_penalty must be >= 0"),
    (["--batch-sentences", "many"], "argument --batch-sentences: invalid int value: 'many'"),
    (["--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
    (["--beams", "2"], "unrecognized arguments: --beams"),
]

for _flags, _text in FLAGS:

    def _flag(env: Env, flags: list[str] = _flags, text: str = _text) -> Spec:
        return Spec(["--model", str(env.checkpoint()), *flags], [text])

    case("translate", " ".join(_flags), "translate")(_flag)


@case("translate", "device-cuda-without-cuda", "translate")
def _(env: Env) -> Spec:
    env.patches.append(("torch.cuda.is_available", lambda: False))
    return Spec(
        ["--model", str(env.checkpoint()), "--device", "cuda"], ["--device cuda: CUDA is not available"]
    )


@case("translate", "no-model-flag", "translate")
def _(env: Env) -> Spec:
    return Spec([], ["the following arguments are required: --model"])


# ------------------------------------------------------------------------------------------ the test


def test_the_table_is_big_enough():
    assert len(CASES) >= 60
    assert len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_one_line_naming_the_culprit(case: Case, env: Env, capsys, monkeypatch):
    spec = case.setup(env)
    held = []
    for target, value in env.patches:
        if target == "_held_fd":
            held.append(value)
        else:
            monkeypatch.setattr(target, value)
    before = set(env.tmp.glob("model/step-*"))
    main, prog = (
        (train_cli.main, "nmt-train") if case.tool == "train" else (translate_cli.main, "nmt-translate")
    )
    try:
        result = call_cli(main, spec.argv, capsys, stdin=spec.stdin)
    finally:
        for fd in held:
            os.close(fd)
    assert result.code == 2, f"exit {result.code}; stderr: {result.err}"
    assert "Traceback" not in result.err
    assert len(result.err_lines) == 1, result.err
    line = result.err_lines[0]
    assert line.startswith(f"{prog}: error: "), line
    for text in spec.expect:
        assert text in line, f"{text!r} not in {line!r}"
    for text in spec.absent:
        assert text not in line, f"{text!r} in {line!r}"
    if case.tool == "train":
        assert set(env.tmp.glob("model/step-*")) == before, "nothing may be trained"
