"""Export a Transformer checkpoint to a CTranslate2 model directory (what `nmt-export ctranslate2` runs).

Why: CTranslate2 is a C++ runtime with int8 CPU kernels, batching and no Python in the decoding loop, so an
exported model translates faster and in less memory than `nmt-translate`, and serves without our code.

The mapping fills CTranslate2's own spec classes (`ctranslate2.specs.TransformerSpec`), one of our tensors per
spec variable, and lets CTranslate2 check, quantise and serialise them. What needs care, and how it is done:
- Positions: ours are sinusoids with sin and cos interleaved (sin on even dims), from position 0;
  CTranslate2's built-in table lays them out differently. We write our own table into
  `position_encodings.encodings`, with `position_rows` rows. CTranslate2 cannot grow it as our model does,
  so the table covers the stored `decode:` limits (inputs cut to `max_input_tokens`, outputs of at most
  `max_len_factor * n + max_len_b` tokens) and at least MIN_POSITION_ROWS positions.
- Source eos: our sources end with eos; `add_source_eos` in the model's config.json makes CTranslate2 append
  it, so callers pass plain sentencepiece pieces. The target starts with bos (`decoder_start_token`).
- Embeddings are scaled by sqrt(d_model) on both sides (`scale_embeddings`); layer norm epsilon is ours.
- Tied embeddings ("all", "decoder"): the shared matrix is written to each place that uses it; CTranslate2
  stores identical variables once (it aliases them when optimising).
- Fused projections: our self-attention `qkv` [3d, d] and cross-attention `q`, `kv` [2d, d] already have
  CTranslate2's layout (q, k, v in that order), so they are copied as they are.
- Pre-norm models get the final encoder and decoder layer norms; post-norm models have none.
- Pad and bos: our beam search never emits them. An output-projection bias of `NEVER_GENERATED_BIAS` on those
  ids keeps CTranslate2 from emitting them too. Our beam search masks them *after* the softmax, this bias
  removes them *before*, so CTranslate2's log-probs are ours minus log(1 - p(pad) - p(bos)): small for a
  trained model, which never sees pad or bos as a target (at most 0.0022 per token on the Bible model after
  1k steps), large on an untrained one. Greedy choices are the same either way (the argmax does not move);
  beam choices can differ only on near-ties. `block_never_generated=False` exports our exact distribution
  (for scoring; CTranslate2 may then emit pad or bos where our beam search would not).

The directory also gets the sentencepiece model(s), `nmt_export.json` (where it came from and the `decode:`
options that `nmt.export.ctranslate2_translate` reuses) and a README.txt showing how to translate with it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import Tensor, nn

from nmt.checkpoint import InferenceBundle, load_inference_bundle
from nmt.data.vocab import BOS_ID, EOS_ID, UNK_ID, Vocab
from nmt.decoding.config import DecodeConfig
from nmt.models.build import build_model
from nmt.models.transformer import Transformer, sinusoidal_positions

QUANTIZATIONS = ("int8", "int16", "float16", "bfloat16", "float32")
# exp(-1e4) is exactly 0 in float32, and -1e4 stays finite in float16 and bfloat16 (max ~6.5e4), so a
# float16 export does not turn the bias into -inf (which some kernels turn into NaN).
NEVER_GENERATED_BIAS = -1.0e4
MIN_POSITION_ROWS = 1024
EXPORT_FILE = "nmt_export.json"
README_FILE = "README.txt"
INSTALL_HINT = "pip install -e '.[serve]'"


class ExportError(ValueError):
    """A model or output directory that cannot be exported; the message is one line saying what to do."""


def require_ctranslate2() -> ModuleType:
    """The `ctranslate2` module, imported on first use so the toolkit does not depend on it."""
    try:
        import ctranslate2
    except ImportError:
        raise ExportError(f"the ctranslate2 package is not installed; run {INSTALL_HINT}") from None
    return ctranslate2


def position_rows(max_positions: int, decode: DecodeConfig) -> int:
    """Rows of the position table: enough for `max_positions`, MIN_POSITION_ROWS and the stored decode limits.

    The source needs `max_input_tokens + 1` positions (eos included); the decoder needs one per output token
    plus bos, at most int(max_len_factor * source length + max_len_b) + 1.
    """
    rows = max(max_positions, MIN_POSITION_ROWS)
    if decode.max_input_tokens:
        source = decode.max_input_tokens + 1
        target = int(decode.max_len_factor * source + decode.max_len_b) + 1
        rows = max(rows, source, target)
    return rows


def vocabulary_pieces(vocab: Vocab) -> list[str]:
    """The token strings of a sentencepiece vocabulary, in id order (CTranslate2's vocabulary file)."""
    return [vocab.sp.id_to_piece(i) for i in range(len(vocab))]


def _copy(tensor: Tensor) -> Tensor:
    # A float32 copy: CTranslate2 quantises in place, and must not write into the model's own weights.
    return tensor.detach().to("cpu", torch.float32).clone()


def _set_linear(spec: Any, linear: nn.Linear) -> None:
    spec.weight = _copy(linear.weight)
    if linear.bias is not None:
        spec.bias = _copy(linear.bias)


def _set_norm(spec: Any, norm: nn.LayerNorm) -> None:
    spec.gamma = _copy(norm.weight)
    spec.beta = _copy(norm.bias)


def _set_ffn(spec: Any, layer: nn.Module) -> None:
    _set_norm(spec.layer_norm, layer.ffn_norm)
    _set_linear(spec.linear_0, layer.ffn.fc1)
    _set_linear(spec.linear_1, layer.ffn.fc2)


def _set_self_attention(spec: Any, layer: nn.Module) -> None:
    _set_norm(spec.layer_norm, layer.self_attn_norm)
    _set_linear(spec.linear[0], layer.self_attn.qkv)  # fused [q; k; v]
    _set_linear(spec.linear[1], layer.self_attn.out)


def transformer_spec(
    ct2: ModuleType, model: Transformer, norm: str, rows: int, block_never_generated: bool = True
) -> Any:
    """A `ctranslate2.specs.TransformerSpec` holding the weights of `model` (vocabularies not yet set).

    Args:
        ct2: the ctranslate2 module.
        model: our Transformer, weights loaded.
        norm: model.norm, "pre" or "post".
        rows: rows of the position table written for both sides.
        block_never_generated: add NEVER_GENERATED_BIAS on pad and bos in the output projection.
    """
    spec = ct2.specs.TransformerSpec.from_config(
        (len(model.encoder_layers), len(model.decoder_layers)),
        model.heads,
        pre_norm=norm == "pre",
        activation=ct2.specs.Activation.RELU,
    )
    positions = sinusoidal_positions(rows, model.d_model)

    encoder = spec.encoder
    encoder.scale_embeddings = True  # x * sqrt(d_model) + position, as `Transformer._embed`
    encoder.embeddings[0].weight = _copy(model.src_embed.weight)
    encoder.position_encodings.encodings = positions.clone()
    if norm == "pre":
        _set_norm(encoder.layer_norm, model.encoder_norm)
    for layer_spec, layer in zip(encoder.layer, model.encoder_layers):
        _set_self_attention(layer_spec.self_attention, layer)
        _set_ffn(layer_spec.ffn, layer)

    decoder = spec.decoder
    decoder.scale_embeddings = True
    decoder.embeddings.weight = _copy(model.tgt_embed.weight)
    decoder.position_encodings.encodings = positions.clone()
    if norm == "pre":
        _set_norm(decoder.layer_norm, model.decoder_norm)
    for layer_spec, layer in zip(decoder.layer, model.decoder_layers):
        _set_self_attention(layer_spec.self_attention, layer)
        cross = layer_spec.attention
        _set_norm(cross.layer_norm, layer.cross_attn_norm)
        _set_linear(cross.linear[0], layer.cross_attn.q)
        _set_linear(cross.linear[1], layer.cross_attn.kv)  # fused [k; v]
        _set_linear(cross.linear[2], layer.cross_attn.out)
        _set_ffn(layer_spec.ffn, layer)
    decoder.projection.weight = _copy(model.output_proj.weight)
    if block_never_generated:
        bias = torch.zeros(model.tgt_vocab_size)
        bias[[model.pad_id, model.bos_id]] = NEVER_GENERATED_BIAS
        decoder.projection.bias = bias
    return spec


def _special_pieces(src: Vocab, tgt: Vocab) -> dict[str, str]:
    """unk/bos/eos pieces for config.json: CTranslate2 has one set for both sides, so they must agree."""
    pieces = {}
    for name, token_id in (("unk_token", UNK_ID), ("bos_token", BOS_ID), ("eos_token", EOS_ID)):
        source, target = src.sp.id_to_piece(token_id), tgt.sp.id_to_piece(token_id)
        if source != target:
            raise ExportError(
                f"{src.path} and {tgt.path}: id {token_id} is {source!r} in the source but {target!r} in "
                f"the target vocabulary; CTranslate2 needs one name per special token, so retrain one of "
                f"them with the other's special piece names"
            )
        pieces[name] = source
    return pieces


def build_spec(bundle: InferenceBundle, block_never_generated: bool = True) -> Any:
    """The validated CTranslate2 spec of a Transformer checkpoint: weights, vocabularies, config."""
    ct2 = require_ctranslate2()
    cfg = bundle.config.model
    if cfg.arch != "transformer":
        raise ExportError(
            f"{bundle.path}: model.arch is {cfg.arch!r}, but nmt-export ctranslate2 converts Transformer "
            f"models only (CTranslate2 has no RNN decoder); translate this model with nmt-translate"
        )
    src, tgt = bundle.src_vocab, bundle.tgt_vocab
    model = build_model(cfg, len(src), len(tgt), pad_id=tgt.pad_id, bos_id=tgt.bos_id, eos_id=tgt.eos_id)
    try:
        model.load_state_dict(bundle.state_dict)
    except RuntimeError as error:
        reason = str(error).strip().splitlines()[0]
        raise ExportError(
            f"{bundle.path}: the weights do not fit its config.yml ({reason}); use the checkpoint's own "
            f"config.yml or another checkpoint"
        ) from None
    rows = position_rows(cfg.max_positions, bundle.config.decode)
    spec = transformer_spec(ct2, model, cfg.norm, rows, block_never_generated)
    spec.register_source_vocabulary(vocabulary_pieces(src))
    spec.register_target_vocabulary(vocabulary_pieces(tgt))
    config = spec.config
    for name, piece in _special_pieces(src, tgt).items():
        setattr(config, name, piece)
    config.decoder_start_token = config.bos_token
    config.add_source_bos = False
    config.add_source_eos = True  # our sources end with eos; callers pass plain pieces
    config.layer_norm_epsilon = float(model.encoder_layers[0].self_attn_norm.eps)
    try:
        spec.validate()
    except ValueError as error:  # a mapping bug, not a user error: say so in one line
        reason = " ".join(str(error).split())
        raise ExportError(
            f"{bundle.path}: CTranslate2 rejected the converted model ({reason}); please report this bug"
        ) from None
    return spec


def check_output_dir(out: Path, force: bool) -> None:
    """Refuse an `out` that is a file, or a non-empty directory unless `force` and it holds an earlier export.

    `force` only ever replaces a directory with a model.bin in it, so a mistyped --out cannot wipe a home
    directory or a checkpoint.
    """
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {out}: exists and is not a directory; choose another --out")
    if not out.is_dir() or not any(out.iterdir()):
        return
    if not force:
        raise ExportError(f"--out {out}: directory exists and is not empty; add --force to replace it")
    if not (out / "model.bin").is_file():
        raise ExportError(
            f"--out {out}: not an earlier export (no model.bin), so --force does not replace it; choose "
            f"another --out or empty the directory yourself"
        )


def export_ctranslate2(
    model_dir: str | os.PathLike,
    out: str | os.PathLike,
    quantization: str = "float32",
    force: bool = False,
    block_never_generated: bool = True,
) -> Path:
    """Write a CTranslate2 model directory for the Transformer checkpoint at `model_dir`.

    Args:
        model_dir: a model directory (its best, else last checkpoint) or a step-* checkpoint directory.
        out: the directory to write; built next to it and renamed into place, so it is never half-written.
        quantization: weight type, one of QUANTIZATIONS.
        force: replace an existing non-empty `out` (only if it holds an earlier export).
        block_never_generated: keep CTranslate2 from emitting pad and bos (see the module docstring).

    Returns `out`. Raises ExportError, CheckpointError or FileNotFoundError with one-line messages.
    """
    out = Path(out)
    if quantization not in QUANTIZATIONS:
        raise ExportError(f"--quantization {quantization}: not one of {', '.join(QUANTIZATIONS)}")
    require_ctranslate2()
    check_output_dir(out, force)
    bundle = load_inference_bundle(model_dir)
    spec = build_spec(bundle, block_never_generated)
    spec.optimize(quantization=quantization)
    tgt = bundle.tgt_vocab
    never_generated = [tgt.pad_id, tgt.bos_id] if block_never_generated else []
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"  # not mkdtemp: that makes it private (0700)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    except OSError as error:
        raise ExportError(
            f"--out {out}: cannot create it ({error.strerror or error}); choose a writable location"
        ) from None
    try:
        spec.save(str(tmp))
        spm_names = _copy_sentencepiece(bundle, tmp)
        info = {
            "format": "ctranslate2",
            "checkpoint": str(bundle.path),
            "step": bundle.meta.get("step"),
            "quantization": quantization,
            "src_spm": spm_names[0],
            "tgt_spm": spm_names[1],
            "position_rows": position_rows(bundle.config.model.max_positions, bundle.config.decode),
            "never_generated": never_generated,
            "decode": dataclasses.asdict(bundle.config.decode),
        }
        (tmp / EXPORT_FILE).write_text(json.dumps(info, indent=1) + "\n", encoding="utf-8")
        (tmp / README_FILE).write_text(readme_text(out, info), encoding="utf-8")
        _replace_dir(tmp, out)
    except OSError as error:
        raise ExportError(
            f"--out {out}: writing the export failed ({error.strerror or error}); free disk space or choose "
            f"another --out"
        ) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already once renamed into place
    return out


def _copy_sentencepiece(bundle: InferenceBundle, out: Path) -> tuple[str, str]:
    """Copy the sentencepiece model(s) under their checkpoint names; returns (source, target) file names."""
    src, tgt = Path(bundle.src_vocab.path), Path(bundle.tgt_vocab.path)
    shutil.copyfile(src, out / src.name)
    if tgt.name != src.name:
        shutil.copyfile(tgt, out / tgt.name)
    return src.name, tgt.name


def _replace_dir(tmp: Path, out: Path) -> None:
    """Move the finished `tmp` to `out`; an earlier export there is moved aside first and removed after."""
    old = None
    if out.is_dir() and any(out.iterdir()):
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        os.replace(out, old / out.name)
    elif out.is_dir():
        out.rmdir()
    os.replace(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def readme_text(out: Path, info: dict[str, Any]) -> str:
    """README.txt: what the directory holds, how to translate with it (plain CTranslate2 and our helper)."""
    decode, rows = info["decode"], info["position_rows"]
    src_spm, tgt_spm = info["src_spm"], info["tgt_spm"]
    beam, alpha = decode["beam_size"], decode["length_penalty"]
    cut, factor, b = decode["max_input_tokens"], decode["max_len_factor"], decode["max_len_b"]
    emitted = "" if info["never_generated"] else " by nmt-translate (this export can emit them)"
    if src_spm == tgt_spm:
        spm_lines = f"  {src_spm:<44}sentencepiece model (source and target)"
    else:
        spm_lines = f"  {src_spm:<44}source sentencepiece model\n  {tgt_spm:<44}target sentencepiece model"
    header = f"{info['checkpoint']} (step {info['step']}, weights {info['quantization']})"
    return f"""CTranslate2 export of {header}, written by `nmt-export ctranslate2`.

Files
  model.bin, config.json, *_vocabulary.json   the CTranslate2 model
{spm_lines}
  {EXPORT_FILE:<44}where it came from, and the checkpoint's decode: options

Translate (pip install ctranslate2 sentencepiece):

  import ctranslate2
  import sentencepiece as spm

  src = spm.SentencePieceProcessor(model_file="{out}/{src_spm}")
  tgt = spm.SentencePieceProcessor(model_file="{out}/{tgt_spm}")
  translator = ctranslate2.Translator("{out}", device="cpu", intra_threads=2)
  pieces = src.encode(["Hola mundo."], out_type=str)   # no eos: the model appends it (add_source_eos)
  results = translator.translate_batch(
      pieces, beam_size={beam}, length_penalty={alpha}, max_decoding_length=256, min_decoding_length=0)
  print([tgt.decode(r.hypotheses[0]) for r in results])

Limits: the position table has {rows} rows, so keep inputs and max_decoding_length under {rows} tokens;
nmt-translate cuts inputs to {cut} pieces (0 = no limit) and allows int({factor} * (pieces + 1) + {b})
output tokens per sentence. Pad and bos are never generated{emitted}.

The same decoding as nmt-translate (input cut, per-sentence length limit, batching), from Python:

  from nmt.export.ctranslate2_translate import translate_with_ctranslate2
  print(translate_with_ctranslate2("{out}", ["Hola mundo."], beam_size={beam}))
"""
