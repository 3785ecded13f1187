"""CTranslate2 export: the exported model computes our model's log-probs and makes our decoding choices.

Tiny random Transformers (every weight and bias perturbed, so a swapped or missing tensor shows) are written
as real checkpoints, exported, and compared with our own forward pass, greedy search and beam search.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence

ctranslate2 = pytest.importorskip("ctranslate2")

from nmt.checkpoint import CheckpointWriter  # noqa: E402
from nmt.config import config_from_dict  # noqa: E402
from nmt.data.config import VocabConfig  # noqa: E402
from nmt.data.vocab import Vocab, train_sentencepiece  # noqa: E402
from nmt.decoding.beam import beam_search  # noqa: E402
from nmt.decoding.config import DecodeConfig  # noqa: E402
from nmt.export.ctranslate2 import (  # noqa: E402
    EXPORT_FILE,
    ExportError,
    export_ctranslate2,
    position_rows,
)
from nmt.export.ctranslate2_translate import ExportedTranslator, translate_with_ctranslate2  # noqa: E402
from nmt.models.build import build_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_thread")  # tests/conftest.py

SIZES = {"d_model": 32, "ffn_dim": 64, "heads": 4, "encoder_layers": 2, "decoder_layers": 2, "dropout": 0.0}


@pytest.fixture(scope="module")
def vocabs(tmp_path_factory, reverse_corpus):
    """A joint vocabulary and a separate source/target pair (different sizes), trained on the reverse task."""
    root = tmp_path_factory.mktemp("spm")
    files = [reverse_corpus / "train.src", reverse_corpus / "train.tgt"]
    joint = Vocab.load(train_sentencepiece(files, root / "joint" / "spm.model", VocabConfig(size=40)))
    src = Vocab.load(train_sentencepiece(files[:1], root / "src" / "spm.model", VocabConfig(size=36)))
    tgt = Vocab.load(train_sentencepiece(files[1:], root / "tgt" / "spm.model", VocabConfig(size=44)))
    return {"joint": (joint, joint), "separate": (src, tgt)}


def fit_briefly(net, vocabs, corpus, steps, batch=32):
    """A few Adam steps on the reverse task: enough for the model to end its sentences (a random one runs
    to the length limit, where our beam search and CTranslate2's differ by design)."""
    src_vocab, tgt_vocab = vocabs
    sources = (corpus / "train.src").read_text().splitlines()
    targets = (corpus / "train.tgt").read_text().splitlines()
    optimizer = torch.optim.Adam(net.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    net.train()
    for _ in range(steps):
        rows = torch.randint(len(sources), (batch,), generator=generator).tolist()
        tgt = [tgt_vocab.encode(targets[i]) for i in rows]
        src = pad_sequence(
            [torch.tensor(src_vocab.encode(sources[i]) + [src_vocab.eos_id]) for i in rows], batch_first=True
        )
        tgt_in = pad_sequence([torch.tensor([tgt_vocab.bos_id] + t) for t in tgt], batch_first=True)
        tgt_out = pad_sequence([torch.tensor(t + [tgt_vocab.eos_id]) for t in tgt], batch_first=True)
        logits = net(src, tgt_in)
        loss = F.cross_entropy(logits.flatten(0, 1), tgt_out.flatten(), ignore_index=tgt_vocab.pad_id)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def write_checkpoint(root, vocabs, arch="transformer", seed=0, corpus=None, train_steps=0, **model):
    """A checkpoint of a random model (every weight perturbed), trained for `train_steps` on `corpus` if
    given; returns (model directory, the model in eval mode)."""
    src, tgt = vocabs
    config = config_from_dict({"model": {"arch": arch, **SIZES, **model}, "decode": {"beam_size": 5}})
    torch.manual_seed(seed)
    net = build_model(config.model, len(src), len(tgt))
    with torch.no_grad():
        for param in net.parameters():
            param.add_(0.1 * torch.randn_like(param))
    if train_steps:
        fit_briefly(net, vocabs, corpus, train_steps)
    writer = CheckpointWriter(root, rank=0, world_size=1, barrier=lambda: None)
    writer.save(1, config, (src, tgt), net.state_dict(), None, {"step": 1}, {})
    return root, net.eval()


def sentence_pairs(reverse_corpus, n=6):
    sources = (reverse_corpus / "test.src").read_text().splitlines()[:n]
    targets = (reverse_corpus / "test.tgt").read_text().splitlines()[:n]
    return sources, targets


def our_token_log_probs(model, src_vocab, tgt_vocab, sources, targets, mask_never_generated=False):
    """Teacher-forced log-probs of each target token and eos, one sentence at a time (no padding)."""
    rows = []
    with torch.no_grad():
        for source, target in zip(sources, targets):
            src = torch.tensor([src_vocab.encode(source) + [src_vocab.eos_id]])
            tgt = tgt_vocab.encode(target)
            logits = model(src, torch.tensor([[tgt_vocab.bos_id] + tgt]))[0]
            if mask_never_generated:
                logits[:, [tgt_vocab.pad_id, tgt_vocab.bos_id]] = float("-inf")
            log_probs = F.log_softmax(logits.float(), dim=-1)
            rows.append(log_probs.gather(1, torch.tensor([tgt + [tgt_vocab.eos_id]]).T)[:, 0])
    return rows


def ct2_token_log_probs(out, src_vocab, tgt_vocab, sources, targets):
    translator = ctranslate2.Translator(str(out), device="cpu", intra_threads=1)
    results = translator.score_batch(
        [src_vocab.sp.encode(s, out_type=str) for s in sources],
        [tgt_vocab.sp.encode(t, out_type=str) for t in targets],
    )
    return [torch.tensor(r.log_probs) for r in results]


def our_best_ids(model, src_vocab, sentences, cfg):
    """Our beam search, one sentence at a time: the best hypothesis' target ids."""
    ids = []
    for sentence in sentences:
        src = torch.tensor([src_vocab.encode(sentence) + [src_vocab.eos_id]])
        ids.append(beam_search([model], src, cfg)[0][0].tokens)
    return ids


def max_difference(ours, theirs):
    assert [len(a) for a in ours] == [len(b) for b in theirs]  # every target token plus eos
    return max(float((a - b).abs().max()) for a, b in zip(ours, theirs))


ARCHITECTURES = [
    ("pre", "all", "joint"),
    ("post", "all", "joint"),
    ("pre", "none", "separate"),
    ("post", "none", "separate"),
    ("pre", "decoder", "separate"),
]


@pytest.mark.parametrize("norm,tie,vocab", ARCHITECTURES)
def test_log_probs_match_ours(tmp_path, vocabs, reverse_corpus, norm, tie, vocab):
    src_vocab, tgt_vocab = vocabs[vocab]
    model_dir, model = write_checkpoint(tmp_path / "model", vocabs[vocab], norm=norm, tie_embeddings=tie)
    sources, targets = sentence_pairs(reverse_corpus)

    exact = export_ctranslate2(model_dir, tmp_path / "exact", block_never_generated=False)
    ours = our_token_log_probs(model, src_vocab, tgt_vocab, sources, targets)
    assert max_difference(ours, ct2_token_log_probs(exact, src_vocab, tgt_vocab, sources, targets)) < 1e-4

    # The default export never emits pad or bos: the same as masking them out before the softmax.
    default = export_ctranslate2(model_dir, tmp_path / "default")
    masked = our_token_log_probs(model, src_vocab, tgt_vocab, sources, targets, mask_never_generated=True)
    assert max_difference(masked, ct2_token_log_probs(default, src_vocab, tgt_vocab, sources, targets)) < 1e-4


@pytest.mark.parametrize("norm,tie,vocab", ARCHITECTURES)
def test_greedy_output_is_ours_token_for_token(tmp_path, vocabs, reverse_corpus, norm, tie, vocab):
    src_vocab, _ = vocabs[vocab]
    model_dir, model = write_checkpoint(tmp_path / "model", vocabs[vocab], norm=norm, tie_embeddings=tie)
    out = export_ctranslate2(model_dir, tmp_path / "ct2")
    sources, _ = sentence_pairs(reverse_corpus, n=10)
    cfg = DecodeConfig(beam_size=1)
    exported = ExportedTranslator(out, intra_threads=1, beam_size=1)
    assert [ids for ids, _ in exported.translate_ids(sources)] == our_best_ids(model, src_vocab, sources, cfg)


@pytest.mark.parametrize("norm,tie,vocab", [("pre", "all", "joint"), ("post", "none", "separate")])
def test_beam_output_is_ours(tmp_path, vocabs, reverse_corpus, norm, tie, vocab):
    src_vocab, tgt_vocab = vocabs[vocab]
    model_dir, model = write_checkpoint(
        tmp_path / "model",
        vocabs[vocab],
        corpus=reverse_corpus,
        train_steps=50,
        norm=norm,
        tie_embeddings=tie,
    )
    out = export_ctranslate2(model_dir, tmp_path / "ct2")
    sources, _ = sentence_pairs(reverse_corpus, n=10)
    ours = our_best_ids(model, src_vocab, sources, DecodeConfig(beam_size=5))
    theirs = [ids for ids, _ in ExportedTranslator(out, intra_threads=1, beam_size=5).translate_ids(sources)]
    assert theirs == ours
    limits = [int(2.0 * (len(src_vocab.encode(s)) + 1) + 10) for s in sources]
    assert all(0 < len(ids) < limit for ids, limit in zip(ours, limits))  # ended by the model, not the limit


def test_int8_export_translates(tmp_path, vocabs, reverse_corpus):
    src_vocab, tgt_vocab = vocabs["joint"]
    model_dir, model = write_checkpoint(tmp_path / "model", vocabs["joint"])
    out = export_ctranslate2(model_dir, tmp_path / "int8", quantization="int8")
    assert json.loads((out / EXPORT_FILE).read_text())["quantization"] == "int8"
    assert (out / "model.bin").stat().st_size < (tmp_path / "model" / "last" / "model.pt").stat().st_size
    sources, _ = sentence_pairs(reverse_corpus, n=8)
    translations = translate_with_ctranslate2(out, sources + [" "], beam_size=5, intra_threads=1)
    assert len(translations) == 9 and translations[-1] == ""
    assert all(t.strip() for t in translations[:-1])


def test_export_directory_holds_what_the_readme_uses(tmp_path, vocabs, reverse_corpus):
    """The README's recipe (plain CTranslate2, sentencepiece pieces without eos) gives our translations."""
    src_vocab, tgt_vocab = vocabs["separate"]
    model_dir, model = write_checkpoint(
        tmp_path / "model", vocabs["separate"], corpus=reverse_corpus, train_steps=50, tie_embeddings="none"
    )
    out = export_ctranslate2(model_dir, tmp_path / "ct2")
    names = sorted(p.name for p in out.iterdir())
    for name in ("README.txt", EXPORT_FILE, "config.json", "model.bin", "src.spm.model", "tgt.spm.model"):
        assert name in names
    config = json.loads((out / "config.json").read_text())
    assert config["add_source_eos"] is True and config["decoder_start_token"] == "<s>"
    assert "translate_batch" in (out / "README.txt").read_text()

    sources, _ = sentence_pairs(reverse_corpus, n=4)
    translator = ctranslate2.Translator(str(out), device="cpu", intra_threads=1)
    pieces = [src_vocab.sp.encode(s, out_type=str) for s in sources]
    results = translator.translate_batch(pieces, beam_size=1, max_decoding_length=512, min_decoding_length=0)
    cfg = DecodeConfig(beam_size=1, max_len_factor=100.0)  # no length limit in either
    ours = [tgt_vocab.decode(ids) for ids in our_best_ids(model, src_vocab, sources, cfg)]
    assert [tgt_vocab.sp.decode(r.hypotheses[0]) for r in results] == ours


def test_position_table_covers_the_decode_limits():
    assert position_rows(1024, DecodeConfig()) == 1024  # 250 input pieces: int(2 * 251 + 10) + 1 = 513
    assert position_rows(64, DecodeConfig(max_input_tokens=1000)) == int(2.0 * 1001 + 10) + 1


def test_rnn_model_is_refused(tmp_path, vocabs):
    model_dir, _ = write_checkpoint(
        tmp_path / "model", vocabs["joint"], arch="rnn", rnn_hidden=16, rnn_embed=16
    )
    with pytest.raises(ExportError, match="model.arch is 'rnn'.*nmt-translate"):
        export_ctranslate2(model_dir, tmp_path / "ct2")
    assert not (tmp_path / "ct2").exists()


def test_output_directory_rules(tmp_path, vocabs):
    model_dir, _ = write_checkpoint(tmp_path / "model", vocabs["joint"])
    out = export_ctranslate2(model_dir, tmp_path / "ct2")
    with pytest.raises(ExportError, match="not empty; add --force"):
        export_ctranslate2(model_dir, out)
    export_ctranslate2(model_dir, out, quantization="int8", force=True)  # replaces an earlier export
    assert json.loads((out / EXPORT_FILE).read_text())["quantization"] == "int8"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary leftovers

    other = tmp_path / "notes"
    other.mkdir()
    (other / "todo.txt").write_text("mine")
    with pytest.raises(ExportError, match="not an earlier export"):
        export_ctranslate2(model_dir, other, force=True)
    assert (other / "todo.txt").read_text() == "mine"
    (tmp_path / "empty").mkdir()
    export_ctranslate2(model_dir, tmp_path / "empty")  # an empty directory is fine
    with pytest.raises(ExportError, match="is not a directory"):
        export_ctranslate2(model_dir, other / "todo.txt")
    with pytest.raises(ExportError, match="--quantization int4"):
        export_ctranslate2(model_dir, tmp_path / "x", quantization="int4")
