"""Runtime data: tokenizers, the packed token memmap and a deterministic, stateless sampler.

A dataset directory (written by tools/prepare_data.py) holds `train.bin` and `val.bin`, flat
arrays of token ids with an EOS after every document, and `meta.json`. The sequences of global
step s are drawn from a generator keyed by (seed, split, s) alone, so they never depend on the
mesh, and resuming at step s needs no sampler state: step s is recomputed from its key.
`data.blend` mixes several datasets by the same key (blend.py); `build_data` builds either.
"""

from __future__ import annotations

import hashlib
import json
import re
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # torch is imported when a batch is made: preparation never needs it
    import torch

from megapipe.config.blend import blend_name, parse_blend
from megapipe.config.schema import ConfigError
from megapipe.data.blend import BlendData

META_FILE = "meta.json"
SPLITS = {"train": 0, "val": 1}  # the split's number is part of the sampler key
DTYPES = ("uint16", "uint32")
SCAN_CHUNK = 1 << 24  # tokens per chunk when scanning a format-1 memmap for its largest id
DOCS_SUFFIX = ".docs.npy"  # <split>.docs.npy: document offsets (documents.py writes them)


class DataError(ValueError):
    """Bad data or data config: the message is one line naming the file or key and the fix."""


# ---------------------------------------------------------------- tokenizers


class SentencePieceTokenizer:
    """A sentencepiece `.model` file."""

    def __init__(self, path: Path):
        import sentencepiece as spm

        self._sp = spm.SentencePieceProcessor(model_file=str(path))
        self.vocab_size = self._sp.get_piece_size()
        self.eos_id = self._sp.eos_id()

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._sp.encode(texts)

    def encode_arrays(self, texts: list[str], threads: int = -1) -> list[np.ndarray]:
        """encode_batch as int32 arrays, with no Python int per token; `threads` for the
        batch (-1: sentencepiece's default, every core)."""
        return self._sp.encode(texts, out_type="numpy", num_threads=threads)

    def decode(self, ids: list[int]) -> str:
        return self._sp.decode(list(ids))


class HFTokenizer:
    """A Hugging Face tokenizer: a local directory, or (`local_only=False`) a Hub id that
    transformers downloads into the HF cache."""

    def __init__(self, path: Path | str, local_only: bool = True):
        from transformers import AutoTokenizer

        self.hf = AutoTokenizer.from_pretrained(str(path), local_files_only=local_only)
        # Documents are separated by EOS; fall back to SEP for BERT-style tokenizers.
        eos = self.hf.eos_token_id if self.hf.eos_token_id is not None else self.hf.sep_token_id
        if eos is None:
            raise DataError(f"tokenizer {path} has no eos_token; add one to its config")
        self.eos_id = int(eos)
        self.vocab_size = len(self.hf)  # counts added tokens, unlike hf.vocab_size

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        backend = getattr(self.hf, "backend_tokenizer", None)  # a fast tokenizer's Rust core
        if backend is not None:  # the ids hf(texts) gives, without its warning for documents
            # longer than the model's context (GPT-2's 1024), which is no error here
            return [e.ids for e in backend.encode_batch(texts, add_special_tokens=False)]
        return self.hf(texts, add_special_tokens=False)["input_ids"]

    def encode_arrays(self, texts: list[str], threads: int = -1) -> list[np.ndarray]:
        """encode_batch as arrays (`threads` is the tokenizers library's own business)."""
        return [np.asarray(row, dtype=np.int64) for row in self.encode_batch(texts)]

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(list(ids))


Tokenizer = SentencePieceTokenizer | HFTokenizer


def load_tokenizer(path: str | Path) -> Tokenizer:
    """A sentencepiece `.model` file or a local HF tokenizer directory."""
    path = Path(path)
    if path.is_dir():
        return HFTokenizer(path)
    if path.is_file():
        return SentencePieceTokenizer(path)
    raise DataError(f"tokenizer '{path}' not found; give a sentencepiece .model file or HF dir")


# A Hub repo id: NAME or ORG/NAME of letters, digits, '-', '_', '.' (as huggingface_hub checks).
HUB_ID = re.compile(r"^(?![./])[\w.-]+(/(?!\.)[\w.-]+)?$")


def is_hub_id(name: str) -> bool:
    return bool(HUB_ID.match(name)) and ".." not in name and not name.endswith(".")


def hub_tokenizer(name: str) -> HFTokenizer:
    """The tokenizer of a Hugging Face Hub repo (e.g. gpt2), through transformers: downloaded
    into the HF cache when online, read from that cache alone when HF_HUB_OFFLINE (or
    TRANSFORMERS_OFFLINE) is set."""
    from huggingface_hub import is_offline_mode

    offline = is_offline_mode()
    try:
        return HFTokenizer(name, local_only=offline)
    except DataError:
        raise
    except (OSError, ValueError) as err:  # transformers raises OSError for a missing repo
        if offline:
            raise DataError(
                f"--tokenizer {name} is not a local dir or .model file, nor in the local Hugging "
                "Face cache (offline mode is set); run once online (unset HF_HUB_OFFLINE) to "
                "download it, or give a local HF tokenizer dir or a sentencepiece .model file"
            ) from None
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise DataError(
            f"--tokenizer {name} is not a local dir or .model file, and the Hugging Face Hub "
            f"gives no tokenizer for it ({first}); check the id or give a local dir"
        ) from None


# ---------------------------------------------------------------- sampling


def _rng(seed: int, split: str, step: int) -> np.random.Generator:
    """The generator for one (seed, split, step): a pure function of the three, no state."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {sorted(SPLITS)}, got {split!r}")
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return np.random.default_rng([seed, SPLITS[split], step])


class TokenData:
    """Batches of `seq_len + 1` tokens (inputs and shifted targets) for any global step."""

    def __init__(self, seq_len: int, vocab_size: int, seed: int):
        self.seq_len = seq_len
        self.vocab_size = vocab_size
        self.seed = seed
        self.tokenizer_path: Path | None = None

    def batch(self, step: int, size: int, split: str = "train") -> torch.Tensor:
        """The global batch of `step`: LongTensor [size, seq_len + 1]."""
        rows = self.draw(_rng(self.seed, split, step), size, split)
        import torch

        return torch.from_numpy(rows.astype(np.int64))

    def draw(self, rng: np.random.Generator, size: int, split: str) -> np.ndarray:
        """`size` rows of seq_len + 1 tokens from `split`, drawn with `rng` (the step's
        generator; a blend passes each dataset a child of it)."""
        raise NotImplementedError


class SyntheticData(TokenData):
    """Uniform random tokens in [0, vocab_size): no files, for tests and benchmarks."""

    def draw(self, rng: np.random.Generator, size: int, split: str) -> np.ndarray:
        return rng.integers(0, self.vocab_size, (size, self.seq_len + 1), dtype=np.int64)


class MemmapData(TokenData):
    """Random windows of a packed token memmap (`train.bin` / `val.bin`)."""

    def __init__(self, root: Path, meta: dict[str, Any], seq_len: int, vocab_size: int, seed: int):
        super().__init__(seq_len, vocab_size, seed)
        self.root = root
        self.meta = meta
        self._maps: dict[str, np.memmap] = {}
        self._checked: set[str] = set()  # splits already passed check_split

    def n_tokens(self, split: str) -> int:
        return int(self.meta[f"n_{split}_tokens"])

    def memmap(self, split: str) -> np.memmap:
        """The split's tokens, opened read-only on first use and kept open."""
        if split not in self._maps:
            path = self.root / f"{split}.bin"
            if not path.is_file():
                raise DataError(f"{path} not found; rerun python tools/prepare_data.py")
            n, dtype = self.n_tokens(split), np.dtype(self.meta["dtype"])
            if path.stat().st_size != n * dtype.itemsize:
                raise DataError(
                    f"{path} holds {path.stat().st_size} bytes but {META_FILE} says {n} "
                    f"{dtype} tokens; rerun python tools/prepare_data.py"
                )
            # np.memmap of an empty file fails; an empty split is a valid zero-length array.
            self._maps[split] = np.memmap(path, dtype=dtype, mode="r") if n else np.zeros(0, dtype)
        return self._maps[split]

    def check_split(self, split: str) -> None:
        """Fail early on a split too short for one sequence or holding out-of-vocab ids."""
        path, tokens = self.root / f"{split}.bin", self.memmap(split)
        if len(tokens) < self.seq_len + 1:
            raise DataError(
                f"{path} has {len(tokens)} tokens, fewer than model.seq_len+1 = "
                f"{self.seq_len + 1}; lower model.seq_len or add data"
            )
        largest = self.meta.get(f"max_{split}_id")
        if largest is None:  # format 1: no recorded largest id, so scan the split once
            # Chunked so a multi-GB memmap is never pulled into memory at once.
            chunks = range(0, len(tokens), SCAN_CHUNK)
            largest = max(int(tokens[i : i + SCAN_CHUNK].max()) for i in chunks)
        else:  # format 2: preparation recorded it; start-up reads no token
            self._check_docs(split)
        if largest >= self.vocab_size:
            raise DataError(
                f"{path} holds token id {largest} >= model.vocab_size {self.vocab_size}; "
                f"set model.vocab_size >= {largest + 1}"
            )
        self._checked.add(split)

    def _check_docs(self, split: str) -> None:
        """The split's document offsets exist and end at its token count (two reads of a
        memory-mapped array, whatever its size)."""
        path = self.root / f"{split}{DOCS_SUFFIX}"
        if not path.is_file():
            raise DataError(f"{path} not found; rerun python tools/prepare_data.py")
        try:
            docs = np.load(path, mmap_mode="r")
        except (OSError, ValueError) as err:
            raise DataError(
                f"{path} is corrupt ({err}); rerun python tools/prepare_data.py"
            ) from None
        n_docs = self.meta.get(f"n_{split}_documents", len(docs) - 1)
        if docs.ndim != 1 or len(docs) != n_docs + 1 or int(docs[-1]) != self.n_tokens(split):
            raise DataError(
                f"{path} does not match {META_FILE} ({n_docs} documents, "
                f"{self.n_tokens(split)} tokens); rerun python tools/prepare_data.py"
            )

    def draw(self, rng: np.random.Generator, size: int, split: str) -> np.ndarray:
        tokens = self.memmap(split)
        if split not in self._checked:
            self.check_split(split)
        starts = rng.integers(0, len(tokens) - self.seq_len, size)  # start + seq_len + 1 <= n
        return tokens[starts[:, None] + np.arange(self.seq_len + 1)]  # (size, seq_len + 1)


# ---------------------------------------------------------------- building


def read_meta(root: Path) -> dict[str, Any]:
    """`meta.json` of a dataset directory, with its required keys checked."""
    path = root / META_FILE
    if not path.is_file():
        raise DataError(f"{path} not found; run python tools/prepare_data.py --out {root}")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as err:
        raise DataError(f"{path} is corrupt ({err}); rerun python tools/prepare_data.py") from None
    required = ("vocab_size", "dtype", "n_train_tokens", "n_val_tokens", "eos_id", "tokenizer")
    missing = [key for key in required if not isinstance(meta, dict) or key not in meta]
    if missing:
        raise DataError(f"{path} lacks {', '.join(missing)}; rerun python tools/prepare_data.py")
    if meta["dtype"] not in DTYPES:
        raise DataError(f"{path} has dtype {meta['dtype']!r}, expected one of {DTYPES}")
    return meta


def build_data(data_cfg: Any, model_cfg: Any, seed: int) -> TokenData | BlendData:
    """The TokenData that `data.source` (or `data.blend`) names, validated against the model
    before training."""
    seq_len, vocab_size = model_cfg.seq_len, model_cfg.vocab_size
    if data_cfg.source == "synthetic":  # checks.py refuses data.blend without memmap
        return SyntheticData(seq_len, vocab_size, seed)
    if data_cfg.source != "memmap":
        raise DataError(f"data.source {data_cfg.source!r} unknown; use synthetic or memmap")
    if getattr(data_cfg, "blend", ""):  # tests build a namespace with only the older keys
        return _build_blend(data_cfg, seq_len, vocab_size, seed)
    root = Path(data_cfg.path)
    if not data_cfg.path or not root.is_dir():
        raise DataError(f"data.path '{data_cfg.path}' not found; {prepare_hint(data_cfg.path)}")
    return _memmap(root, data_cfg.tokenizer, seq_len, vocab_size, seed)


# Corpora the presets name (configs/gpt2_*.yaml, gpt3_13b.yaml, llama_1b.yaml): the dir's basename
# -> the prepare_data options that make it (the presets' headers give the same commands, and
# tests/test_presets_data.py runs them): GPT-2's own tokenizer, 50257 ids, which the models pad
# to 50304; the Llama preset's 32000-piece sentencepiece. Any other path keeps the plain hint,
# which makes data/shakespeare.
PRESET_CORPORA = {
    "openwebtext": "--input hf:Skylion007/openwebtext --tokenizer gpt2",
    "openwebtext_32k": "--input hf:Skylion007/openwebtext --vocab-size 32000",
}


def prepare_hint(path: str) -> str:
    """How to make the dataset `path` names: for a preset's corpus, the command that prepares
    that very path (the corpus streamed from the Hub); else the Shakespeare default."""
    name = Path(path).name if path else ""
    if name not in PRESET_CORPORA:
        return "run python tools/prepare_data.py or set data.path"
    return (
        "prepare it (online, or with the corpus in the local HF cache): python "
        f"tools/prepare_data.py {PRESET_CORPORA[name]} --out {path} --workers 8"
    )


def _memmap(root: Path, tokenizer: str, seq_len: int, vocab_size: int, seed: int) -> MemmapData:
    """One prepared dataset, its meta checked against the model and its train split scanned."""
    meta = read_meta(root)
    if meta["vocab_size"] > vocab_size:
        raise DataError(
            f"{root / META_FILE} has vocab_size {meta['vocab_size']} > model.vocab_size "
            f"{vocab_size}; set model.vocab_size >= {meta['vocab_size']}"
        )
    data = MemmapData(root, meta, seq_len, vocab_size, seed)
    data.tokenizer_path = _tokenizer_path(tokenizer, root, meta)
    data.check_split("train")  # val is checked on its first batch: training may never use it
    return data


def _build_blend(data_cfg: Any, seq_len: int, vocab_size: int, seed: int) -> BlendData:
    """`data.blend`'s datasets, which must exist and share one tokenizer, mixed by weight."""
    try:
        entries = parse_blend(data_cfg.blend)
    except ConfigError as err:  # validated configs pass; a hand-built one fails here alike
        raise DataError(str(err)) from None
    tokenizers = {}  # path -> (vocab_size, tokenizer fingerprint), checked before any scan
    for path, _ in entries:
        if not (Path(path) / META_FILE).is_file():
            raise DataError(
                f"data.blend dataset '{path}' not found (no {META_FILE}); prepare it with "
                f"python tools/prepare_data.py --out {path} or fix data.blend"
            )
        meta = read_meta(Path(path))
        tokenizers[path] = (meta["vocab_size"], _fingerprint(Path(path) / meta["tokenizer"]))
        first = entries[0][0]
        if tokenizers[path] != tokenizers[first]:
            raise DataError(
                f"data.blend: {path} has another tokenizer than {first} (vocab_size or "
                f"{meta['tokenizer']} differ); prepare every blended dataset with the same "
                "--tokenizer"
            )
    datasets = {
        blend_name(path): _memmap(Path(path), data_cfg.tokenizer, seq_len, vocab_size, seed)
        for path, _ in entries
    }
    return BlendData(datasets, [weight for _, weight in entries], partial(_rng, seed), seq_len)


def _fingerprint(path: Path) -> str:
    """sha256 of a tokenizer file, or of a tokenizer dir's files (names and bytes, sorted)."""
    digest = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for file in files:
        digest.update(str(file.relative_to(path) if path.is_dir() else file.name).encode())
        digest.update(file.read_bytes() if file.is_file() else b"")
    return digest.hexdigest()


def _tokenizer_path(configured: str, root: Path, meta: dict[str, Any]) -> Path:
    """`data.tokenizer` if set, else the tokenizer the dataset was made with (relative to it)."""
    if not configured:
        return root / meta["tokenizer"]
    if not Path(configured).exists():
        raise DataError(f"data.tokenizer '{configured}' not found; fix it or leave it empty")
    return Path(configured)
