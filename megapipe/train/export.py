"""Export a checkpoint written under any mesh to a transformers directory, with its tokenizer.

`export_hf(checkpoint, out)` reads the checkpoint whole on one process
(`checkpoint.load_for_inference`: every tensor is stored under its logical name and shape, so the
dp, pp, tp, cp, vpp and zero setting that wrote it does not matter), writes it through
`models/hf.to_hf` (GPT-2 class for model.arch=gpt2, Llama class for llama) and adds the run's
tokenizer:

- the tokenizer is `data.tokenizer` of the checkpoint's config.yaml, else the one recorded in the
  dataset's meta.json (`data.path`, or the first `data.blend` dataset: blended datasets share one
  tokenizer), else none (synthetic data: the export holds the weights only);
- a local HF tokenizer dir is re-saved as it is; a sentencepiece `.model` (what
  tools/prepare_data.py trains) is converted to a `tokenizer.json` that `tokenizers` runs
  without sentencepiece: the same pieces, merges (BPE) or scores (unigram), byte fallback and
  whitespace handling, no special token added on encode and control pieces such as `</s>` not
  matched in text (`split_special_tokens`), so `AutoTokenizer(text).input_ids` are the ids the
  run's data holds. The `.model` file is copied beside it;
- bos_token_id = eos_token_id = the run's eos id (meta.json `eos_id`) in config.json and
  generation_config.json: the data is `doc EOS doc EOS ...`, so EOS is also the token every
  document follows (GPT-2's convention; a sentencepiece `<s>` is never in the data).

The directory is written beside `out` under a temporary name and renamed into place; an `out`
that exists and is not empty is refused unless `force`. Errors are one line (`ExportError`,
`CheckpointError`, `DataError`).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from megapipe.config import Config
from megapipe.config.blend import parse_blend
from megapipe.data.layout import META_FILE
from megapipe.data.layout import read_meta as read_data_meta
from megapipe.data.prepare import replace_dir
from megapipe.data.tokenizers import load_tokenizer
from megapipe.models.hf import to_hf
from megapipe.train.checkpoint import complete_checkpoints, load_for_inference, read_meta

SPM_FILE = "tokenizer.model"
# Encoded by both sentencepiece and the converted tokenizer.json at export: a mismatch is reported.
PROBE = "Thou art  the king\n\n of night,\tmy lord!  é 漢字 <s></s> 42 "


class ExportError(ValueError):
    """A bad --checkpoint, --out or tokenizer for an export: the message is one line."""


@dataclass
class Exported:
    """What `export_hf` wrote: the checkpoint it read, the run's tokenizer and notes."""

    out: Path
    checkpoint: Path
    step: int
    cfg: Config
    n_params: int
    eos_id: int | None
    tokenizer: Path | None  # the source file or dir; None: weights only
    notes: list[str]


# ---------------------------------------------------------------- the run's tokenizer


def run_tokenizer(cfg: Config, ckpt: Path) -> tuple[Path | None, int | None, str]:
    """(tokenizer path, eos id, note) of the run that wrote `ckpt`: data.tokenizer, else the
    dataset's meta.json; (None, None, why) for synthetic data."""
    where = f"(config.yaml of {ckpt})"
    fix = (
        "run from the directory the run was trained in, or pass --tokenizer PATH or --no-tokenizer"
    )
    data = cfg.data
    if data.tokenizer:
        if not Path(data.tokenizer).exists():
            raise ExportError(f"data.tokenizer '{data.tokenizer}' {where} not found; {fix}")
        return Path(data.tokenizer), None, ""
    if data.source != "memmap":
        return None, None, "no tokenizer: the run used synthetic data; exported the weights only"
    path = parse_blend(data.blend)[0][0] if data.blend else data.path
    key = "data.blend" if data.blend else "data.path"
    root = Path(path)
    if not root.is_dir():
        raise ExportError(f"{key} '{path}' {where} not found; {fix}")
    if not (root / META_FILE).is_file():
        raise ExportError(f"{key} '{path}' {where} has no {META_FILE}; {fix}")
    meta = read_data_meta(root)
    tokenizer = root / meta["tokenizer"]
    if not tokenizer.exists():
        raise ExportError(f"{tokenizer} (named by {root / META_FILE}) not found; {fix}")
    return tokenizer, int(meta["eos_id"]), ""


def spm_to_hf(model_file: Path, eos_id: int):
    """A transformers fast tokenizer (tokenizer.json) that encodes as the sentencepiece model
    does; bos and eos both the piece `eos_id`, no special token added on encode."""
    from sentencepiece import sentencepiece_model_pb2 as pb
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    proto = pb.ModelProto()
    try:
        proto.ParseFromString(model_file.read_bytes())
    except Exception as e:  # protobuf's DecodeError
        raise ExportError(
            f"{model_file} is not a sentencepiece model ({e}); pass --tokenizer"
        ) from None
    trainer, norm, kinds = proto.trainer_spec, proto.normalizer_spec, pb.ModelProto.SentencePiece
    pieces = [(p.piece, p.score) for p in proto.pieces]
    unk = pieces[trainer.unk_id][0]
    if trainer.model_type == pb.TrainerSpec.BPE:
        normal = {p.piece for p in proto.pieces if p.type == kinds.NORMAL}
        vocab = {piece: i for i, (piece, _) in enumerate(pieces)}
        model = models.BPE(
            vocab, _merges(vocab, normal), unk_token=unk, fuse_unk=True,
            byte_fallback=trainer.byte_fallback,
        )  # fmt: skip
    elif trainer.model_type == pb.TrainerSpec.UNIGRAM:
        model = models.Unigram(pieces, trainer.unk_id, trainer.byte_fallback)
    else:
        kind = pb.TrainerSpec.ModelType.Name(trainer.model_type)
        raise ExportError(f"{model_file}: sentencepiece model_type {kind} has no HF conversion")
    tok = Tokenizer(model)
    steps = (
        [normalizers.Precompiled(norm.precompiled_charsmap)] if norm.precompiled_charsmap else []
    )
    if norm.remove_extra_whitespaces:
        steps += [normalizers.Strip(), normalizers.Replace(Regex(" {2,}"), " ")]
    if norm.add_dummy_prefix:
        steps.append(normalizers.Prepend("▁"))
    if norm.escape_whitespaces:
        steps.append(normalizers.Replace(" ", "▁"))
    tok.normalizer = normalizers.Sequence(steps)
    decode = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(
        decode + ([decoders.Strip(" ", 1, 0)] if norm.add_dummy_prefix else [])
    )
    special = [p.piece for p in proto.pieces if p.type in (kinds.UNKNOWN, kinds.CONTROL)]
    tok.add_special_tokens([AddedToken(s, normalized=False, special=True) for s in special])
    user = [p.piece for p in proto.pieces if p.type == kinds.USER_DEFINED]
    tok.add_tokens([AddedToken(s, normalized=False, special=False) for s in user])
    eos = pieces[eos_id][0]
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token=unk, bos_token=eos, eos_token=eos,
        split_special_tokens=True, clean_up_tokenization_spaces=False,
    )  # fmt: skip


def _merges(vocab: dict[str, int], normal: set[str]) -> list[tuple[str, str]]:
    """BPE merges from sentencepiece pieces: a piece is the merge of any two pieces it splits
    into, ranked by the piece's id (sentencepiece's merge order), shorter left part first."""
    merges = []
    for piece in sorted(normal, key=vocab.__getitem__):
        splits = [(piece[:i], piece[i:]) for i in range(1, len(piece))]
        splits = [(a, b) for a, b in splits if a in normal and b in normal]
        merges += sorted(splits, key=lambda ab: (len(ab[0]), vocab[ab[0]], vocab[ab[1]]))
    return merges


def save_tokenizer(path: Path, eos_id: int, out: Path, vocab_size: int) -> list[str]:
    """Write the tokenizer at `path` (an HF dir or a sentencepiece .model) into `out`; returns
    notes (a mismatch of the converted tokenizer on the probe text)."""
    if path.is_dir():
        tok = load_tokenizer(path).hf  # local_files_only
        _check_size(len(tok), vocab_size, path)
        tok.save_pretrained(str(out))
        return []
    import sentencepiece as spm

    try:
        sp = spm.SentencePieceProcessor(model_file=str(path))
    except (OSError, RuntimeError) as e:
        raise ExportError(f"{path} is not a sentencepiece model ({e}); pass --tokenizer") from None
    _check_size(sp.get_piece_size(), vocab_size, path)
    tok = spm_to_hf(path, eos_id)
    tok.save_pretrained(str(out))
    shutil.copyfile(path, out / SPM_FILE)
    if tok(PROBE)["input_ids"] != sp.encode(PROBE):
        return [
            f"warning: tokenizer.json encodes some text unlike {path.name}; for exact ids use "
            f"the copied {SPM_FILE} with sentencepiece"
        ]
    return []


def _check_size(n_tokens: int, vocab_size: int, path: Path) -> None:
    if n_tokens > vocab_size:
        raise ExportError(
            f"tokenizer {path} has {n_tokens} tokens > model.vocab_size {vocab_size}; "
            "pass the run's tokenizer with --tokenizer"
        )


# ---------------------------------------------------------------- the export


def find_checkpoint(path: Path) -> Path:
    """`path` if it is a checkpoint, else the newest complete one under a run dir."""
    if not path.is_dir():
        raise ExportError(f"--checkpoint '{path}' not found; pass a step_* dir or a run dir")
    if (path / "meta.json").is_file():
        return path
    found = complete_checkpoints(str(path / "checkpoints")) or complete_checkpoints(str(path))
    if not found:
        raise ExportError(
            f"no complete checkpoint (step_*/meta.json) under '{path}'; pass a step_* dir or a "
            "run dir that saved one (checkpoint.interval > 0)"
        )
    return Path(found[-1])


def _check_out(out: Path, force: bool, ckpt: Path) -> None:
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out '{out}' is a file; pick a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ExportError(f"--out '{out}' exists and is not empty; pass --force to replace it")
    if ckpt.resolve().is_relative_to(out.resolve()):
        raise ExportError(f"--out '{out}' holds the checkpoint {ckpt}; pick another --out")


def export_hf(
    checkpoint: str | Path,
    out: str | Path,
    *,
    force: bool = False,
    tokenizer: str | Path | None = None,
    with_tokenizer: bool = True,
) -> Exported:
    """Write the checkpoint (a step_* dir, or the newest under a run dir) to `out` as a
    transformers directory with the run's tokenizer (`tokenizer` overrides it; none when
    `with_tokenizer` is False); see the module docstring."""
    from transformers.utils import logging as hf_logging

    ckpt, out = find_checkpoint(Path(checkpoint)), Path(out)
    _check_out(out, force, ckpt)
    step = int(read_meta(str(ckpt))["step"])
    cfg, model = load_for_inference(str(ckpt))
    notes: list[str] = []
    tok_path, eos_id = None, None
    if tokenizer is not None:
        tok_path = Path(tokenizer)
        if not tok_path.exists():
            raise ExportError(f"--tokenizer '{tok_path}' not found; give a .model file or HF dir")
    elif with_tokenizer:
        tok_path, eos_id, note = run_tokenizer(cfg, ckpt)
        notes += [note] if note else []
    else:
        notes.append("no tokenizer (--no-tokenizer): exported the weights only")
    if tok_path is not None and eos_id is None:
        eos_id = load_tokenizer(tok_path).eos_id
        if eos_id < 0:  # a sentencepiece model trained with --eos_id=-1
            raise ExportError(f"tokenizer {tok_path} has no eos piece; pass one that has")
    hf_logging.disable_progress_bar()
    target = out.resolve()
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        to_hf(model, str(tmp), eos_id=eos_id)
        if tok_path is not None:
            notes += save_tokenizer(tok_path, eos_id, tmp, cfg.model.vocab_size)
        replace_dir(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    n_params = sum(p.numel() for p in model.parameters())
    return Exported(out, ckpt, step, cfg, n_params, eos_id, tok_path, notes)
