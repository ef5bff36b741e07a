"""Runtime data: the packed token memmap and a deterministic, stateless sampler.

A dataset directory (written by tools/prepare_data.py) holds `train.bin` and `val.bin`, flat
arrays of token ids with an EOS after every document, their documents' offsets (`*.docs.npy`)
and `meta.json` (docs/data.md). The rows of global step s depend on the seed and s alone, never
on the mesh, and resuming at step s needs no sampler state: with `data.sampler: epochs` they are
samples [s·B, (s+1)·B) of the split's sample index (sample_index.py), with `random` windows
drawn by a generator keyed by (seed, split, s). A dp rank reads only its rows (`batch(...,
rows=)`). `data.blend` mixes several datasets (blend.py); `build_data` builds either.
"""

from __future__ import annotations

import hashlib
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # torch is imported when a batch is made: preparation never needs it
    import torch

from megapipe.config.blend import blend_name, parse_blend
from megapipe.config.schema import ConfigError
from megapipe.data.blend import BlendData
from megapipe.data.errors import DataError
from megapipe.data.layout import META_FILE, read_docs, read_meta
from megapipe.data.sample_index import SPLITS, SampleIndex, gather

SCAN_CHUNK = 1 << 24  # tokens per chunk when scanning a format-1 memmap for its largest id


# ---------------------------------------------------------------- sampling

SAMPLERS = ("epochs", "random")


def check_step(split: str, step: int) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {sorted(SPLITS)}, got {split!r}")
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")


def step_rng(seed: int, split: str, step: int) -> np.random.Generator:
    """The generator for one (seed, split, step): a pure function of the three, no state."""
    check_step(split, step)
    return np.random.default_rng([seed, SPLITS[split], step])


def row_range(size: int, rows: slice | None) -> range:
    """The rows `rows` selects of a global batch of `size` (None: all of them)."""
    picked = range(size)[rows if rows is not None else slice(None)]
    if picked.step != 1:
        raise ValueError(f"rows must be a contiguous slice, got {rows}")
    return picked


class TokenData:
    """Batches of `seq_len + 1` tokens (inputs and shifted targets) for any global step."""

    def __init__(self, seq_len: int, vocab_size: int, seed: int):
        self.seq_len = seq_len
        self.vocab_size = vocab_size
        self.seed = seed
        self.tokenizer_path: Path | None = None

    def batch(
        self, step: int, size: int, split: str = "train", rows: slice | None = None
    ) -> torch.Tensor:
        """The global batch of `step`, or only its rows `rows` (a dp rank's slice, read alone):
        LongTensor [len(rows), seq_len + 1]."""
        check_step(split, step)
        out = self.rows(step, size, split, row_range(size, rows))
        import torch

        return torch.from_numpy(out.astype(np.int64))

    def rows(self, step: int, size: int, split: str, picked: range) -> np.ndarray:
        """Rows `picked` of step `step`'s global batch of `size`."""
        keep = slice(picked.start, picked.stop)
        return self.draw(step_rng(self.seed, split, step), size, split, keep)

    def draw(self, rng: np.random.Generator, size: int, split: str, keep: Any = None) -> np.ndarray:
        """`size` rows of seq_len + 1 tokens from `split`, drawn with `rng` (the step's
        generator; a blend passes each dataset a child of it); only rows `keep` (a numpy index
        into the `size`) are returned, the draw itself the same."""
        raise NotImplementedError


class SyntheticData(TokenData):
    """Uniform random tokens in [0, vocab_size): no files, for tests and benchmarks."""

    def draw(self, rng: np.random.Generator, size: int, split: str, keep: Any = None) -> np.ndarray:
        rows = rng.integers(0, self.vocab_size, (size, self.seq_len + 1), dtype=np.int64)
        return rows if keep is None else rows[keep]


class MemmapData(TokenData):
    """Windows of a packed token memmap (`train.bin` / `val.bin`): with the epochs sampler the
    split's sample index (sample_index.py), with the random one windows drawn anywhere."""

    def __init__(
        self,
        root: Path,
        meta: dict[str, Any],
        seq_len: int,
        vocab_size: int,
        seed: int,
        sampler: str = "random",
        samples: dict[str, int] | None = None,
    ):
        super().__init__(seq_len, vocab_size, seed)
        self.root = root
        self.meta = meta
        self.sampler = sampler
        self.samples = dict(samples or {})  # split -> samples the run reads (index size hint)
        self.bytes_read = 0  # token bytes read from the memmaps so far (benchmarks)
        self._maps: dict[str, np.memmap] = {}
        self._docs: dict[str, np.ndarray] = {}
        self._indices: dict[str, SampleIndex] = {}
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
        if largest is None:  # format 1: no recorded largest id (format 2: no token read)
            # Chunked so a multi-GB memmap is never pulled into memory at once.
            chunks = range(0, len(tokens), SCAN_CHUNK)
            largest = max(int(tokens[i : i + SCAN_CHUNK].max()) for i in chunks)
        if largest >= self.vocab_size:
            raise DataError(
                f"{path} holds token id {largest} >= model.vocab_size {self.vocab_size}; "
                f"set model.vocab_size >= {largest + 1}"
            )
        self._checked.add(split)

    def docs(self, split: str) -> np.ndarray:
        """`<split>.docs.npy`, memory-mapped (format 2; DataError naming the fix if absent)."""
        if split not in self._docs:
            self._docs[split] = read_docs(self.root, split, self.meta)
        return self._docs[split]

    def sample_index(self, split: str, samples: int = 0) -> SampleIndex:
        """The split's epochs index holding at least `samples` samples (and the run's hint):
        opened from the cache, or built there first. A larger one is a superset (each epoch's
        order is its own), so growing it changes no sample already read."""
        index = self._indices.get(split)
        if index is None or index.n_samples < samples:
            if split not in self._checked:
                self.check_split(split)
            want = max(samples, self.samples.get(split, 0), 1)
            docs = self.docs(split)
            index = SampleIndex.open(self.root, split, docs, self.seq_len, self.seed, want)
            self._indices[split] = index
        return index

    def rows(self, step: int, size: int, split: str, picked: range) -> np.ndarray:
        if self.sampler == "random":
            return super().rows(step, size, split, picked)
        return self.read(np.arange(step * size + picked.start, step * size + picked.stop), split)

    def pieces(self, samples: np.ndarray, split: str) -> tuple[np.ndarray, ...]:
        """(row, document, begin, end) of the epochs samples' windows (sample_index.py)."""
        needed = int(samples.max()) + 1 if len(samples) else 0
        return self.sample_index(split, needed).pieces(samples)

    def read(self, samples: np.ndarray, split: str) -> np.ndarray:
        """The tokens of epochs samples `samples` (int array): only their pieces are read."""
        _, _, begin, end = self.pieces(samples, split)
        self.bytes_read += int((end - begin).sum()) * self.memmap(split).itemsize
        return gather(self.memmap(split), begin, end, self.seq_len + 1)

    def random_starts(self, rng: np.random.Generator, size: int, split: str) -> np.ndarray:
        """The random sampler's window starts: `size` of them, with replacement."""
        tokens = self.memmap(split)
        if split not in self._checked:
            self.check_split(split)
        return rng.integers(0, len(tokens) - self.seq_len, size)  # start + seq_len + 1 <= n

    def draw(self, rng: np.random.Generator, size: int, split: str, keep: Any = None) -> np.ndarray:
        starts = self.random_starts(rng, size, split)
        starts = starts if keep is None else starts[keep]
        self.bytes_read += len(starts) * (self.seq_len + 1) * self.memmap(split).itemsize
        return self.memmap(split)[starts[:, None] + np.arange(self.seq_len + 1)]  # (n, L + 1)


# ---------------------------------------------------------------- building


def run_samples(train_cfg: Any) -> dict[str, int]:
    """The samples a run reads per split (train.steps and train.eval_batches global batches):
    how large the epochs sampler's indices are built at start-up."""
    return {
        "train": train_cfg.steps * train_cfg.global_batch,
        "val": train_cfg.eval_batches * train_cfg.global_batch,
    }


def build_data(
    data_cfg: Any, model_cfg: Any, seed: int, samples: dict[str, int] | None = None
) -> TokenData | BlendData:
    """The TokenData that `data.source` (or `data.blend`) names, validated against the model
    before training. With the epochs sampler and `samples` (run_samples), the train index is
    opened (built if not cached) here, before step 0; other sizes grow on demand."""
    seq_len, vocab_size = model_cfg.seq_len, model_cfg.vocab_size
    if data_cfg.source == "synthetic":  # checks.py refuses data.blend without memmap
        return SyntheticData(seq_len, vocab_size, seed)
    if data_cfg.source != "memmap":
        raise DataError(f"data.source {data_cfg.source!r} unknown; use synthetic or memmap")
    sampler = getattr(data_cfg, "sampler", "epochs")  # tests build namespaces of older keys
    if sampler not in SAMPLERS:
        raise DataError(f"data.sampler {sampler!r} unknown; use {' or '.join(SAMPLERS)}")
    if getattr(data_cfg, "blend", ""):
        return _build_blend(data_cfg, seq_len, vocab_size, seed, sampler, samples)
    root = Path(data_cfg.path)
    if not data_cfg.path or not root.is_dir():
        raise DataError(f"data.path '{data_cfg.path}' not found; {prepare_hint(data_cfg.path)}")
    data = _memmap(root, data_cfg.tokenizer, seq_len, vocab_size, seed, sampler, samples)
    if sampler == "epochs" and samples:
        data.sample_index("train")
    return data


# Corpora the presets name (configs/gpt2_*.yaml, gpt3_13b.yaml, llama_*.yaml): the dir's basename
# -> the prepare_data options that make it (the presets' headers give the same commands, and
# tests/test_presets_data.py runs them): GPT-2's own tokenizer, 50257 ids, which the models pad
# to 50304; llama_1b's 32000-piece sentencepiece; llama_8b's Llama 3 tokenizer (128256 ids).
# Any other path keeps the plain hint, which makes data/shakespeare.
OPENWEBTEXT = "hf:Skylion007/openwebtext@refs/convert/parquet"  # a script repo: data/hub.py
FINEWEB_EDU = "hf:HuggingFaceFW/fineweb-edu:sample-10BT:train"  # gpt2_124m_fineweb, parquet
PRESET_CORPORA = {
    "openwebtext": f"--input {OPENWEBTEXT} --tokenizer gpt2",
    "openwebtext_32k": f"--input {OPENWEBTEXT} --vocab-size 32000",
    "openwebtext_llama3": f"--input {OPENWEBTEXT} --tokenizer meta-llama/Meta-Llama-3-8B",
    "openwebtext_qwen3": f"--input {OPENWEBTEXT} --tokenizer Qwen/Qwen3-0.6B-Base",
    "fineweb_edu_10b": f"--input {FINEWEB_EDU} --tokenizer gpt2 --val-fraction 0.01",
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


def _memmap(
    root: Path,
    tokenizer: str,
    seq_len: int,
    vocab_size: int,
    seed: int,
    sampler: str = "random",
    samples: dict[str, int] | None = None,
) -> MemmapData:
    """One prepared dataset, its meta checked against the model and its train split checked;
    the epochs sampler needs its documents (format 2)."""
    meta = read_meta(root)
    if meta["vocab_size"] > vocab_size:
        raise DataError(
            f"{root / META_FILE} has vocab_size {meta['vocab_size']} > model.vocab_size "
            f"{vocab_size}; set model.vocab_size >= {meta['vocab_size']}"
        )
    data = MemmapData(root, meta, seq_len, vocab_size, seed, sampler, samples)
    data.tokenizer_path = _tokenizer_path(tokenizer, root, meta)
    data.check_split("train")  # val is checked on its first batch: training may never use it
    if sampler == "epochs":
        data.docs("train")  # format 1 is refused here, before any step
    return data


def _build_blend(
    data_cfg: Any,
    seq_len: int,
    vocab_size: int,
    seed: int,
    sampler: str,
    samples: dict[str, int] | None,
) -> BlendData:
    """`data.blend`'s datasets, which must exist and share one tokenizer, mixed by weight
    (each dataset's epochs index sized by its share: BlendData)."""
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
    own = {"val": samples["val"]} if samples else None  # each dataset's own val batches
    datasets = {
        blend_name(path): _memmap(
            Path(path), data_cfg.tokenizer, seq_len, vocab_size, seed, sampler, own
        )
        for path, _ in entries
    }
    weights = [weight for _, weight in entries]
    return BlendData(datasets, weights, partial(step_rng, seed), seq_len, sampler, samples)


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
