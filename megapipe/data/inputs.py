"""Corpus inputs as streams of documents: nothing here holds more than one document (or one
parquet batch) in memory, so a corpus of any size can be read, and read again, cheaply.

Inputs are files, directories (searched recursively for the known extensions, sorted) and
globs. Kinds: `.txt` (one document per file, per blank-line-separated paragraph or per line:
`txt_doc`), `.jsonl` / `.json` (JSON lines, one document per row, also `.gz` and `.zst`),
`.parquet` (streamed in batches), Hugging Face datasets saved with `save_to_disk`
(memory-mapped by `datasets.load_from_disk`) and, as `hf:NAME[:CONFIG[:SPLIT]][@REVISION]`,
Hugging Face Hub datasets (data/hub.py: streamed online, the local datasets cache offline).
Every failure is a one-line DataError
naming the file and, for JSON lines and compressed files, the line number.
"""

from __future__ import annotations

import codecs
import glob
import gzip
import io
import json
import zlib
from collections.abc import Iterator
from pathlib import Path

from megapipe.data.errors import DataError, first_line
from megapipe.data.hub import HF_PREFIX, HFInput, load_hub

EXTENSIONS = (".jsonl.gz", ".json.gz", ".jsonl.zst", ".json.zst", ".jsonl", ".json", ".txt",
              ".parquet")  # fmt: skip
HF_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
TXT_DOCS = ("file", "paragraph", "line")
BATCH_ROWS = 256  # parquet / HF rows per read: small, documents can be large


def check_utf8(path: Path, chunk: int = 1 << 20) -> None:
    """Raise DataError naming the byte offset of the first invalid UTF-8 sequence."""
    decoder, offset = codecs.getincrementaldecoder("utf-8")(), 0
    with path.open("rb") as f:
        while True:
            block = f.read(chunk)
            try:
                decoder.decode(block, final=not block)
            except UnicodeDecodeError as err:
                # The decoder may hold back a few bytes of an unfinished sequence from before.
                pending = len(decoder.getstate()[0])
                raise DataError(
                    f"{path} is not UTF-8: invalid byte at offset {offset - pending + err.start}"
                ) from None
            if not block:
                return
            offset += len(block)


# ---------------------------------------------------------------- finding the input files


def is_hf_dataset(path: Path) -> bool:
    return path.is_dir() and any((path / marker).is_file() for marker in HF_MARKERS)


def extension(path: Path) -> str | None:
    name = path.name.lower()
    return next((ext for ext in EXTENSIONS if name.endswith(ext)), None)


def expand_inputs(inputs: list[str | Path]) -> list[Path | HFInput]:
    """Files and datasets named by `inputs`, in order, each checked (fails fast)."""
    paths: list[Path | HFInput] = []
    for given in inputs:
        text = str(given)
        if text.startswith(HF_PREFIX):
            paths.append(HFInput.parse(text))
        elif glob.has_magic(text):
            matches = sorted(glob.glob(text, recursive=True))
            if not matches:
                raise DataError(f"input glob {text} matches nothing; check the pattern")
            paths += [p for match in matches for p in _expand_path(Path(match))]
        else:
            paths += _expand_path(Path(given))
    for path in paths:
        check_input(path)
    return paths


def _expand_path(path: Path) -> list[Path]:
    if is_hf_dataset(path) or not path.is_dir():
        return [path]
    found = sorted(p for p in path.rglob("*") if p.is_file() and extension(p))
    if not found:
        raise DataError(f"input dir {path} holds no {'/'.join(EXTENSIONS)} files")
    return found


def check_input(path: Path | HFInput) -> str:
    """The input's extension ("hf" for a saved dataset, "hf-hub" for a Hub dataset), after
    checking it can be read."""
    if isinstance(path, HFInput):
        load_hub(path)
        return "hf-hub"
    if is_hf_dataset(path):
        return "hf"
    if not path.is_file():
        raise DataError(f"input file {path} not found")
    ext = extension(path)
    if ext is None:
        raise DataError(f"input file {path}: unknown extension; use one of {sorted(EXTENSIONS)}")
    if ext.endswith(".zst") and _zstandard() is None:
        raise DataError(f"input file {path}: reading .zst needs zstandard; pip install zstandard")
    if path.stat().st_size == 0:
        raise DataError(f"input file {path} is empty")
    return ext


def _zstandard():
    try:
        import zstandard
    except ImportError:
        return None
    return zstandard


# ---------------------------------------------------------------- documents


def iter_documents(paths: list[Path], text_field: str, txt_doc: str) -> Iterator[str]:
    """Every non-empty document of every input, in order; an input with no text is an error."""
    for path in paths:
        ext = check_input(path)
        if ext == ".txt":
            docs, what = _txt_documents(path, txt_doc), ""
        elif ext == ".parquet":
            docs, what = _parquet_documents(path, text_field), f" in field '{text_field}'"
        elif ext in ("hf", "hf-hub"):
            docs, what = _hf_documents(path, text_field), f" in field '{text_field}'"
        else:
            docs, what = _jsonl_documents(path, text_field), f" in field '{text_field}'"
        has_text = False
        for doc in docs:
            has_text = has_text or bool(doc.strip())
            if doc:
                yield doc
        if not has_text:
            raise DataError(f"input file {path} is empty: no text{what}")


def _decode(path: Path, data: bytes, offset: int) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise DataError(
            f"{path} is not UTF-8: invalid byte at offset {offset + err.start}"
        ) from None


def _txt_documents(path: Path, txt_doc: str) -> Iterator[str]:
    """file: the whole file; paragraph: runs of non-blank lines; line: each non-blank line."""
    if txt_doc == "file":
        yield _decode(path, path.read_bytes(), 0)
        return
    paragraph: list[str] = []
    offset = 0
    with path.open("rb") as f:
        for raw in f:
            line = _decode(path, raw, offset)
            offset += len(raw)
            if not line.strip():
                if paragraph:
                    yield "".join(paragraph).rstrip("\r\n")
                paragraph = []
            elif txt_doc == "line":
                yield line.rstrip("\r\n")
            else:
                paragraph.append(line)
    if paragraph:
        yield "".join(paragraph).rstrip("\r\n")


def _open_stream(path: Path):
    """A binary line-iterable stream, decompressed on the fly."""
    name = path.name.lower()
    if name.endswith(".gz"):
        return gzip.open(path, "rb")
    if name.endswith(".zst"):
        return io.BufferedReader(_ZstdFrames(path.open("rb")))
    return path.open("rb")


class _ZstdFrames(io.RawIOBase):
    """The decompressed bytes of every zstd frame of a file, one after another.

    zstandard's own stream_reader ends quietly at a truncated frame, which would drop the
    documents after the cut without a word; this reader raises EOFError there instead.
    """

    BLOCK = 1 << 20  # compressed bytes per read

    def __init__(self, raw):
        self._raw = raw
        self._decompressor = _zstandard().ZstdDecompressor()
        self._frame = self._decompressor.decompressobj()
        self._in_frame = False  # bytes of an unfinished frame have been fed
        self._offset = 0  # compressed bytes read so far
        self._out = memoryview(b"")  # decompressed, not yet read (a view: slicing copies nothing)

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while not self._out:
            data = self._raw.read(self.BLOCK)
            if not data:
                if self._in_frame:
                    raise EOFError(f"zstd frame truncated at byte offset {self._offset}")
                return 0
            self._offset += len(data)
            self._out = memoryview(self._feed(data))
        size = min(len(buffer), len(self._out))
        buffer[:size] = self._out[:size]
        self._out = self._out[size:]
        return size

    def _feed(self, data: bytes) -> bytes:
        parts = []
        while data:
            parts.append(self._frame.decompress(data))
            self._in_frame = not self._frame.eof
            if not self._frame.eof:
                break
            data = self._frame.unused_data  # the next frame's start, if any
            self._frame = self._decompressor.decompressobj()
        return b"".join(parts)

    def close(self) -> None:
        self._raw.close()
        super().close()


def _numbered_lines(path: Path, stream) -> Iterator[tuple[int, bytes]]:
    """(line number, line); a corrupt compressed stream is a DataError at the line it broke."""
    errors: tuple[type[BaseException], ...] = (OSError, EOFError, zlib.error)
    zstandard = _zstandard()
    if zstandard is not None:
        errors += (zstandard.ZstdError,)
    number, lines = 0, iter(stream)
    while True:
        try:
            line = next(lines)
        except StopIteration:
            return
        except errors as err:
            reason = str(err) or type(err).__name__
            raise DataError(
                f"input file {path} is corrupt at line {number + 1}: {reason}"
            ) from None
        number += 1
        yield number, line


def _json_array_rows(path: Path, stream) -> Iterator[tuple[int, bytes]]:
    """A .json file holding one array of rows (read whole: not streamed), as numbered rows."""
    try:
        rows = json.loads(stream.read())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise DataError(f"input file {path} is not valid json: JSON parse error: {err}") from None
    return ((i, json.dumps(row).encode()) for i, row in enumerate(rows, 1))


def _jsonl_documents(path: Path, field: str) -> Iterator[str]:
    """JSON lines, one row per line; a .json file may instead hold one array of rows."""
    seen_field = False
    with _open_stream(path) as stream:
        is_array = path.suffix.lower() == ".json" and stream.peek(64).lstrip()[:1] == b"["
        rows = _json_array_rows(path, stream) if is_array else _numbered_lines(path, stream)
        for number, raw in rows:
            if not raw.strip():
                continue
            try:
                row = json.loads(raw.decode("utf-8"))  # utf-8: skips json's encoding sniffing
            except UnicodeDecodeError:
                raise DataError(f"input file {path} is not UTF-8 at line {number}") from None
            except json.JSONDecodeError as err:
                raise DataError(
                    f"input file {path} is not valid json: JSON parse error at line {number} "
                    f"column {err.colno}: {err.msg}"
                ) from None
            if not isinstance(row, dict):
                raise DataError(f"input file {path}: line {number} is not a JSON object")
            seen_field = seen_field or field in row
            text = row.get(field)
            if text is not None and not isinstance(text, str):
                raise DataError(
                    f"input file {path}: field '{field}' holds non-string values (line {number})"
                )
            if text is not None:
                yield text
    if not seen_field:
        raise DataError(f"input file {path} has no field '{field}'; set --text-field")


def _parquet_documents(path: Path, field: str) -> Iterator[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
        if field not in parquet.schema_arrow.names:
            raise DataError(f"input file {path} has no field '{field}'; set --text-field")
        kind = parquet.schema_arrow.field(field).type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
            raise DataError(f"input file {path}: field '{field}' holds non-string values")
        for batch in parquet.iter_batches(batch_size=BATCH_ROWS, columns=[field]):
            yield from (text for text in batch.column(0).to_pylist() if text is not None)
    except (pa.ArrowException, OSError) as err:
        reason = first_line(err)
        raise DataError(f"input file {path} is not valid parquet: {reason}") from None


def _hf_documents(path: Path | HFInput, field: str) -> Iterator[str]:
    """A dataset saved with `save_to_disk` or of the Hub (every split of a dataset dict, in
    key order), read in batches of BATCH_ROWS rows."""
    from datasets import load_from_disk

    if isinstance(path, HFInput):
        dataset = load_hub(path)
    else:
        try:
            dataset = load_from_disk(str(path))
        except (OSError, ValueError) as err:
            raise DataError(f"input dataset {path} cannot be loaded: {err}") from None
    parts = [dataset[k] for k in dataset] if isinstance(dataset, dict) else [dataset]
    no_field = f"input dataset {path} has no field '{field}'; set --text-field"
    for part in parts:
        names = part.column_names  # None for a stream whose features are not declared
        if names is not None and field not in names:
            raise DataError(no_field)
        rows = part.select_columns([field]) if names is not None else part
        for batch in rows.iter(batch_size=BATCH_ROWS):
            if field not in batch:
                raise DataError(no_field)
            for text in batch[field]:
                if text is not None and not isinstance(text, str):
                    raise DataError(
                        f"input dataset {path}: field '{field}' holds non-string values"
                    )
                if text is not None:
                    yield text
