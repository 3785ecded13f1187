"""Sentencepiece vocabularies: trained on first use, reused afterwards, fixed special ids, clear errors."""

import multiprocessing
import pickle
import random
from pathlib import Path

import pytest
import sentencepiece as spm

import nmt.data.vocab
from nmt.data.config import VocabConfig
from nmt.data.vocab import Vocab, VocabError, load_or_train_vocabs, train_sentencepiece

SPANISH = ["el", "la", "casa", "perro", "niño", "grande", "come", "pan", "agua", "bebe", "sí", "ñandú"]
GREEK = ["ο", "η", "σπίτι", "σκύλος", "παιδί", "μεγάλο", "τρώει", "ψωμί", "νερό", "πίνει"]


def corpus(tmp_path: Path, n: int = 200, seed: int = 0) -> tuple[Path, Path]:
    rng = random.Random(seed)
    src, tgt = tmp_path / "train.es", tmp_path / "train.el"
    src.write_text("".join(" ".join(rng.choices(SPANISH, k=rng.randint(1, 10))) + "\n" for _ in range(n)))
    tgt.write_text("".join(" ".join(rng.choices(GREEK, k=rng.randint(1, 10))) + "\n" for _ in range(n)))
    return src, tgt


def small(**kw) -> VocabConfig:
    return VocabConfig(size=kw.pop("size", 60), **kw)


def test_joint_vocab_is_trained_on_first_use_and_reused(tmp_path):
    src, tgt = corpus(tmp_path)
    out = tmp_path / "model"
    sv, tv = load_or_train_vocabs(small(), str(src), str(tgt), out)
    model = out / "spm.model"
    assert sv is tv and sv.path == model
    assert model.is_file() and (out / "spm.vocab").is_file()
    assert [p.name for p in out.iterdir() if p.name.startswith(".")] == []  # temp dir cleaned up
    assert (sv.pad_id, sv.unk_id, sv.bos_id, sv.eos_id) == (0, 1, 2, 3)
    # Joint: both languages are covered by the one model.
    assert sv.unk_id not in sv.encode("el niño bebe agua") + sv.encode("το παιδί πίνει νερό")

    mtime = model.stat().st_mtime_ns
    sv2, tv2 = load_or_train_vocabs(small(), str(src), str(tgt), out)
    assert model.stat().st_mtime_ns == mtime  # reused, not retrained
    assert sv2 is tv2 and len(sv2) == len(sv)


def test_explicit_model_path_is_trained_there(tmp_path):
    src, tgt = corpus(tmp_path)
    path = tmp_path / "vocabs" / "joint.model"
    sv, _ = load_or_train_vocabs(small(model=str(path)), str(src), str(tgt), tmp_path / "unused")
    assert sv.path == path and path.is_file() and path.with_suffix(".vocab").is_file()
    assert not (tmp_path / "unused").exists()


def test_separate_vocabs_are_each_trained_on_their_own_side(tmp_path):
    src, tgt = corpus(tmp_path)
    cfg = small(model=str(tmp_path / "src.model"), tgt_model=str(tmp_path / "tgt.model"))
    sv, tv = load_or_train_vocabs(cfg, str(src), str(tgt), tmp_path)
    assert sv is not tv
    assert sv.unk_id not in sv.encode("el niño bebe agua")
    assert tv.unk_id not in tv.encode("το παιδί πίνει νερό")
    assert sv.unk_id in sv.encode("νερό")  # the source model never saw Greek
    assert tv.unk_id in tv.encode("ñandú")


def test_encode_decode_round_trip_and_special_ids_dropped(tmp_path):
    src, tgt = corpus(tmp_path)
    vocab, _ = load_or_train_vocabs(small(), str(src), str(tgt), tmp_path)
    text = "el perro grande come pan"
    ids = vocab.encode(text)
    assert ids and all(i > vocab.eos_id for i in ids)  # no bos/eos added
    assert vocab.decode(ids) == text
    assert vocab.decode([vocab.bos_id, *ids, vocab.eos_id, vocab.pad_id, vocab.pad_id]) == text
    assert vocab.encode_batch([text, "sí"]) == [ids, vocab.encode("sí")]
    assert 16 <= len(vocab) <= 60


def test_vocab_survives_pickling(tmp_path):
    src, tgt = corpus(tmp_path)
    vocab, _ = load_or_train_vocabs(small(), str(src), str(tgt), tmp_path)
    copy = pickle.loads(pickle.dumps(vocab))
    assert copy.path == vocab.path and copy.encode("la casa") == vocab.encode("la casa")


def test_training_samples_deterministically(tmp_path):
    src, tgt = corpus(tmp_path, n=400)
    cfg = small(train_sentences=80, type="bpe")
    a = train_sentencepiece([src, tgt], tmp_path / "a.model", cfg, seed=3)
    b = train_sentencepiece([src, tgt], tmp_path / "b.model", cfg, seed=3)
    pieces = [
        [(v.sp.id_to_piece(i), v.sp.get_score(i)) for i in range(len(v))] for v in map(Vocab.load, (a, b))
    ]
    assert pieces[0] == pieces[1]


def test_failed_training_leaves_no_model_behind(tmp_path):
    src, tgt = corpus(tmp_path)
    cfg = small(character_coverage=7.0)  # rejected by sentencepiece
    with pytest.raises(VocabError, match="sentencepiece training failed"):
        load_or_train_vocabs(cfg, str(src), str(tgt), tmp_path / "m")
    assert list((tmp_path / "m").iterdir()) == []


def test_load_missing_model(tmp_path):
    with pytest.raises(VocabError, match=r"missing\.model: sentencepiece model not found"):
        Vocab.load(tmp_path / "missing.model")


def test_load_something_that_is_not_a_model(tmp_path):
    path = tmp_path / "spm.vocab"
    path.write_text("<pad>\t0\n")
    with pytest.raises(VocabError, match=r"spm\.vocab: not a sentencepiece model"):
        Vocab.load(path)


def test_load_model_with_other_special_ids(tmp_path):
    src, _ = corpus(tmp_path)
    spm.SentencePieceTrainer.train(
        input=str(src),
        model_prefix=str(tmp_path / "default"),
        vocab_size=40,
        hard_vocab_limit=False,
        minloglevel=2,
    )
    with pytest.raises(
        VocabError, match=r"default\.model: special ids .* are \(-1, 0, 1, 2\), expected \(0, 1, 2, 3\)"
    ):
        Vocab.load(tmp_path / "default.model")


def _load_in_worker(args: tuple[Path, Path, Path]) -> int:
    src, tgt, out = args
    vocab, _ = load_or_train_vocabs(small(), str(src), str(tgt), out)
    return len(vocab)


def test_concurrent_local_workers_train_only_once(tmp_path, monkeypatch):
    src, tgt = corpus(tmp_path)
    log = tmp_path / "trained.log"
    real = nmt.data.vocab.train_sentencepiece

    def counting(*args, **kwargs):
        with open(log, "a") as f:
            f.write("trained\n")
        return real(*args, **kwargs)

    monkeypatch.setattr(nmt.data.vocab, "train_sentencepiece", counting)
    with multiprocessing.get_context("fork").Pool(3) as pool:
        sizes = pool.map(_load_in_worker, [(src, tgt, tmp_path / "m")] * 3)
    assert len(set(sizes)) == 1
    assert log.read_text() == "trained\n"
