"""Reading DCP's `.metadata` without running code planted in it.

torch's FileSystemReader reads a checkpoint's `.metadata` with a plain `pickle.load`, which
calls whatever a pickle names: a checkpoint copied from someone else (or altered on a shared
disk) could run code in every process that resumes from it, before any check. `.metadata`
holds only DCP's own records (tensor and chunk metadata, storage infos, torch.Size, dtypes,
layouts, paths), so `SafeReader` reads it with an unpickler that resolves those and refuses
every other global: a payload is a one-line error, never a call.

The records then decide what is read from the `.distcp` files: tensors go through torch.load's
weights-only unpickler, but an entry recorded as "bytes" (a pickled object) would reach DCP's
`load_bytes`, a plain `torch.load(weights_only=False)`. megapipe writes tensors only, so
`check_records` refuses any bytes entry, any transform (DCP's stream extensions) and any data
path that is not a file of the checkpoint's own directory recorded in its meta.json, before a
byte of data is read.
"""

from __future__ import annotations

import os
import pathlib
import pickle
from collections.abc import Collection
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

METADATA_FILE = ".metadata"  # DCP's file of the checkpoint's records, in its directory
DCP_MODULES = ("torch.distributed.checkpoint.",)  # DCP's record classes live here
NAMED = {  # globals that DCP's records pickle besides its own classes: (module, name)
    ("torch", "Size"), ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"), ("copyreg", "_reconstructor"),
    ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "slice"), ("builtins", "object"),
}  # fmt: skip
PATHS = ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")


class Refused(pickle.UnpicklingError):
    """A checkpoint file that asks for something other than tensors and DCP's records."""


class MetadataUnpickler(pickle.Unpickler):
    """An unpickler for DCP's records: its own classes, the globals of NAMED, torch's dtypes
    and pathlib's paths; anything else raises pickle.UnpicklingError naming the global."""

    def find_class(self, module: str, name: str) -> Any:
        found = super().find_class(module, name) if self._allowed(module, name) else None
        if found is None:
            raise Refused(
                f"{METADATA_FILE} names {module}.{name}, which is not a DCP record: refused"
            )
        return found

    @staticmethod
    def _allowed(module: str, name: str) -> bool:
        if (module, name) in NAMED or (module == "pathlib" and name in PATHS):
            return True
        if module == "torch":
            return isinstance(getattr(torch, name, None), torch.dtype)
        if module.startswith(DCP_MODULES):  # a class DCP defines, not any name its module holds
            found = getattr(__import__(module, fromlist=[name]), name, None)
            return isinstance(found, type) and found.__module__ == module
        return False


def read_metadata(path: str, recorded: Collection[str] | None = None) -> Metadata:
    """The `.metadata` of the checkpoint directory `path`, read with MetadataUnpickler, its
    records checked (`recorded`: the files meta.json records, where it records them)."""
    with open(os.path.join(path, METADATA_FILE), "rb") as f:
        metadata = MetadataUnpickler(f).load()
    if not isinstance(metadata, Metadata):
        raise Refused(f"{METADATA_FILE} holds {type(metadata).__name__}")
    check_records(metadata, recorded)
    return metadata


def check_records(metadata: Metadata, recorded: Collection[str] | None = None) -> None:
    """Refuse records that would make a read run code, leave the directory or read a file that
    meta.json does not record (`recorded`), as the module doc says."""
    for fqn, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            raise Refused(
                f"{METADATA_FILE} records {fqn} as a pickled object, which a resume never "
                "unpickles (megapipe checkpoints hold tensors only): refused"
            )
    for index, info in (metadata.storage_data or {}).items():
        where = getattr(info, "relative_path", None)
        if not isinstance(where, str) or os.path.basename(where) != where or where in ("..", "."):
            raise Refused(f"{METADATA_FILE} places {index.fqn} at {where!r}: refused")
        if recorded is not None and where not in recorded:
            raise Refused(f"{METADATA_FILE} places {index.fqn} in {where}, a file meta.json "
                          "does not record: refused")  # fmt: skip
        if getattr(info, "transform_descriptors", None):
            raise Refused(
                f"{METADATA_FILE} asks for transforms {list(info.transform_descriptors)} on "
                f"{index.fqn} in {where}, which megapipe never writes: refused"
            )


class SafeReader(FileSystemReader):
    """FileSystemReader whose `.metadata` is read by read_metadata (no code runs from it) once,
    when it is made: outside dcp.load, so a refused file raises pickle.UnpicklingError itself
    rather than inside DCP's wrapped exceptions."""

    def __init__(self, path: str, recorded: Collection[str] | None = None) -> None:
        super().__init__(path)
        self._metadata = read_metadata(str(pathlib.Path(self.path)), recorded)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = self._metadata
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id  # as FileSystemReader does
        return metadata
