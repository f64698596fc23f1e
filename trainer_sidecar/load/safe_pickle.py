"""Unpickle DCP's ``.metadata`` with an allow-list: a bucket writer must not run code here.

DCP stores a checkpoint's ``Metadata`` as a pickle, and a pickle is a program:
``pickle.loads`` will call any importable callable it names (``os.system``,
``builtins.eval``, ...). Whoever can write to the bucket can write a manifest
naming chunks of their choosing, so the bytes of ``.metadata`` are as
untrusted as the bucket's ACL.

``MetadataUnpickler.find_class`` resolves only the globals a DCP metadata
pickle needs (the ``torch.distributed.checkpoint.metadata`` dataclasses,
``torch.Size``, dtypes, layouts and memory formats looked up by name and
checked by type, ``OrderedDict``, the file-system writer's ``_StorageInfo``,
the ``pathlib`` paths stock DCP records as a checkpoint id); anything else is
refused before it is resolved, so nothing it names is imported or called.
The set was taken from real saves (plain, DDP and FSDP2 models with AdamW
state, through ctj's writer and DCP's FileSystemWriter) on the installed
torch; tests/unit/test_safe_pickle.py re-derives it, so a torch upgrade that
adds a global fails there first.

Enum members pickle by value on most Pythons and as ``builtins.getattr(cls, name)``
on others (Debian bookworm's 3.11.2 among them: the python:3.11 images), so a save
from one may be read on the other. ``getattr`` resolves to a stand-in that looks up
a member of an allowed enum by name and does nothing else.

Allowing a class lets the pickle construct it with arguments of its choosing
(and set its attributes), never anything more: every allowed class is a plain
record, a tuple, a dict or an enum. The shape of what comes out is checked by
``checks.check_metadata`` before any of it is used.
"""

from __future__ import annotations

import collections
import enum
import io
import pathlib
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata

from ..errors import UnsafeCheckpointError

_DCP = "torch.distributed.checkpoint.metadata"

ALLOWED_CLASSES: dict[tuple[str, str], Any] = {
    (_DCP, "Metadata"): dcp_metadata.Metadata,
    (_DCP, "MetadataIndex"): dcp_metadata.MetadataIndex,
    (_DCP, "TensorStorageMetadata"): dcp_metadata.TensorStorageMetadata,
    (_DCP, "BytesStorageMetadata"): dcp_metadata.BytesStorageMetadata,
    (_DCP, "ChunkStorageMetadata"): dcp_metadata.ChunkStorageMetadata,
    (_DCP, "TensorProperties"): dcp_metadata.TensorProperties,
    (_DCP, "StorageMeta"): dcp_metadata.StorageMeta,
    # TensorProperties pickles its memory format as this enum (memory_format can't pickle)
    (_DCP, "_MEM_FORMAT_ENCODING"): dcp_metadata._MEM_FORMAT_ENCODING,
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    ("torch", "Size"): torch.Size,
    ("collections", "OrderedDict"): collections.OrderedDict,
    # StorageMeta.checkpoint_id of a FileSystemWriter save: building a path touches nothing
    ("pathlib", "PosixPath"): pathlib.PosixPath,
    ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
}
"""Classes a DCP metadata pickle may name, by (module, name)."""

_TORCH_VALUE_TYPES = (torch.dtype, torch.layout, torch.memory_format)


def _layout_by_name(name: object) -> torch.layout:
    """Stands in for ``torch.serialization._get_layout`` (how torch pickles a layout):
    the same lookup, restricted to a string naming a ``torch.layout``."""
    attr = name.removeprefix("torch.") if isinstance(name, str) else ""
    if name == f"torch.{attr}" and attr.isidentifier():
        value = getattr(torch, attr, None)
        if isinstance(value, torch.layout):
            return value
    raise pickle.UnpicklingError(f"{name!r} is not a torch layout")


def _enum_member(cls: object, name: object) -> enum.Enum:
    """Stands in for ``builtins.getattr`` (how some Pythons pickle an enum member): only
    ``cls[name]`` for an allowed enum and one of its member names."""
    if cls in _ALLOWED_ENUMS and isinstance(cls, enum.EnumMeta) and isinstance(name, str):
        member = cls.__members__.get(name)
        if member is not None:
            return member
    raise pickle.UnpicklingError(f"getattr({cls!r}, {name!r}) is not an enum member lookup")


_ALLOWED_ENUMS = tuple(
    c for c in ALLOWED_CLASSES.values() if isinstance(c, type) and issubclass(c, enum.Enum)
)


class Refused(pickle.UnpicklingError):
    """The pickle names a global outside the allow-list (it was not imported or called)."""

    def __init__(self, module: str, name: str) -> None:
        super().__init__(module, name)
        self.module = module
        self.name = name

    def __str__(self) -> str:
        return f"names {self.module}.{self.name}, which is not allowed in DCP metadata"


class MetadataUnpickler(pickle.Unpickler):
    """An Unpickler that resolves only what DCP metadata is made of (see the module doc)."""

    def find_class(self, module: str, name: str) -> Any:
        allowed = ALLOWED_CLASSES.get((module, name))
        if allowed is not None:
            return allowed
        if module == "torch.serialization" and name == "_get_layout":
            return _layout_by_name
        if module == "builtins" and name == "getattr":
            return _enum_member
        if module == "torch" and name.isidentifier():  # dtypes, layouts, memory formats
            value = getattr(torch, name, None)
            if isinstance(value, _TORCH_VALUE_TYPES):
                return value
        raise Refused(module, name)

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("DCP metadata has no persistent ids")


def load_metadata(data: bytes, *, step: int, what: str = ".metadata") -> Metadata:
    """``data`` unpickled by the allow-list; raises UnsafeCheckpointError (naming ``step``)
    for a refused global or anything that is not well-formed DCP ``Metadata``."""
    try:
        result = MetadataUnpickler(io.BytesIO(data)).load()
    except Refused as exc:
        raise UnsafeCheckpointError(step, what, str(exc)) from None
    except Exception as exc:  # noqa: BLE001 - any malformed pickle: unusable, never a crash
        reason = f"does not unpickle as DCP metadata ({type(exc).__name__}: {exc})"
        raise UnsafeCheckpointError(step, what, reason) from None
    if not isinstance(result, Metadata):
        raise UnsafeCheckpointError(
            step, what, f"holds a {type(result).__name__}, not DCP Metadata"
        )
    return result
