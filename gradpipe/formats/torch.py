"""Read PyTorch ``.pt`` / ``.pth`` files (``torch.save`` output), safely.

Files are loaded with ``torch.load(weights_only=True)``: torch's restricted
unpickler builds tensors, containers and plain values only and refuses every
other global *before* calling it, so a malicious checkpoint cannot run code.
Files that need arbitrary unpickling are refused with a message saying how to
re-save them.

A checkpoint is a tree of dicts, lists and tuples (a ``state_dict``, an
optimizer state dict, ``{"model": ..., "grads": ..., "step": 7}``). It is
flattened to dotted names (``model.dense1.weight``, ``optim.state.0.exp_avg``;
a list index is one segment). Tensors become arrays; str, int, float, bool and
None leaves become string metadata under their flattened name (``str(value)``);
anything else is refused. A file holding a single tensor names it after the
file stem.

torch is an optional dependency, imported only when a torch file is read.
Torch files cannot be read by byte range: a tensor may be any strided view of a
shared storage, so every read loads the whole file.

A tensor's bytes must come from storage actually in the file: a view whose
elements repeat storage (``expand``, stride 0, overlapping ``as_strided``) would
turn a kilobyte file into gigabytes, so it is refused with a message saying to
``.clone()`` it before saving. Views that merely skip elements (a transpose, a
slice) are read as before.

The same holds for the file as a whole: many names may refer to one storage
(``{f"w{i}": t for i in range(64)}`` saves ``t`` once and claims it 64 times),
so all tensors of one file together may claim at most
:data:`SHARED_STORAGE_FACTOR` times the file's size plus
:data:`SHARED_STORAGE_FLOOR`, checked before anything is copied.

torch.load checks no CRC-32, so gradpipe does: a zip-format file's records are
read through and checked against their CRC-32s before their tensors are taken
(the header read checks the small records only, and maps the storages without
reading them). A damaged byte fails the file instead of being ingested as a value.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import posixpath
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import IO, TYPE_CHECKING, Final

import numpy as np
from dask.utils import format_bytes

from gradpipe.core.display import PATH_LIMIT, printable
from gradpipe.core.dtypes import bfloat16
from gradpipe.errors import InvalidInputError
from gradpipe.formats.checksum import damaged, reason
from gradpipe.formats.spec import TensorSpec, check_tensor_values, parse_tensor_spec

if TYPE_CHECKING:
    import torch

    from gradpipe.formats.registry import DumpSource

__all__ = [
    "READER",
    "SHARED_STORAGE_FACTOR",
    "SHARED_STORAGE_FLOOR",
    "TorchReader",
    "check_claimed",
    "load_checkpoint",
    "load_torch",
    "tensor_spec",
    "tensor_to_numpy",
]

#: How many times its own size the tensors of one file may claim in total. A
#: storage is saved once however many tensors refer to it; weight tying (an
#: embedding shared with the output layer) legitimately gives one storage two
#: names, so 2 is the common case; 4 leaves room for a few more shared names
#: while keeping a file from claiming without bound (64 names for one storage
#: made a 64 MiB file ingest as 4 GiB).
SHARED_STORAGE_FACTOR: Final = 4
#: Added to the bound, in bytes, so a tiny file's tensors are never refused for
#: the file's fixed overhead; it costs nothing worth guarding.
SHARED_STORAGE_FLOOR: Final = 1 << 20

# Bytes read at a time when a record's CRC-32 is checked.
_CRC_PIECE: Final = 1 << 22
_CLONE: Final = "call .clone() or .contiguous() on it before torch.save"
_RESAVE: Final = (
    "re-save it with torch.save(model.state_dict()) (tensors, dicts, lists and plain values "
    "only) or as safetensors"
)
# torch dtypes numpy represents exactly, by torch name; bfloat16 is handled apart.
_NUMPY_DTYPES: Final = frozenset(
    f"torch.{name}"
    for name in (
        "bool",
        "uint8",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint16",
        "uint32",
        "uint64",
        "float16",
        "float32",
        "float64",
    )
)


def _summary(exc: BaseException) -> str:
    # torch's weights-only errors are paragraphs; the chained error names the cause.
    inner = exc.__context__ if isinstance(exc, pickle.UnpicklingError) else None
    text = str(inner or exc).strip().splitlines()
    line = text[0] if text else type(exc).__name__
    return line if len(line) <= 200 else line[:197] + "..."


def _load(f: IO[bytes] | str, path: str) -> object:
    try:
        import torch
    except ImportError:
        raise InvalidInputError(
            f"{printable(path, limit=PATH_LIMIT)}: reading PyTorch files needs torch; install it "
            "with pip install 'gradpipe[torch]'"
        ) from None
    try:
        if isinstance(f, str):
            try:
                return torch.load(f, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as exc:
                if "mmap" not in str(exc):
                    raise
                # A legacy (non-zip) file cannot be mapped: read it.
        return torch.load(f, map_location="cpu", weights_only=True)
    except OSError:
        raise  # the storage backend failed, not the file: let the caller see it
    except pickle.UnpicklingError as exc:
        reason = _summary(exc)
        if "Unsupported global" in str(exc):
            raise InvalidInputError(
                f"{printable(path, limit=PATH_LIMIT)}: refused for safety: loading it would need "
                "arbitrary unpickling "
                f"({reason}), which can run code from the file; {_RESAVE}"
            ) from None
        raise InvalidInputError(
            f"{printable(path, limit=PATH_LIMIT)}: not a readable PyTorch file ({reason}): it is "
            "damaged, not written "
            f"by torch.save, or would need unsafe unpickling; {_RESAVE}"
        ) from None
    except Exception as exc:  # torch raises about anything on a corrupt file
        raise InvalidInputError(
            f"{printable(path, limit=PATH_LIMIT)}: not a readable PyTorch file "
            f"({type(exc).__name__}: {_summary(exc)}); "
            "check that it was written by torch.save and copied completely"
        ) from None


def _dtype_name(tensor: torch.Tensor, where: str) -> str:
    import torch

    if tensor.layout != torch.strided or tensor.is_quantized:
        raise InvalidInputError(
            f"{where} is a {tensor.layout} / quantized tensor; dump dense tensors "
            "(tensor.to_dense(), tensor.dequantize())"
        )
    dtype = str(tensor.dtype)
    if dtype == "torch.bfloat16":
        return "bfloat16"
    if dtype not in _NUMPY_DTYPES:
        raise InvalidInputError(
            f"{where} has dtype {dtype}, which gradpipe does not store; convert it "
            "(e.g. tensor.float()) before saving"
        )
    return dtype.removeprefix("torch.")


def _check_view(tensor: torch.Tensor, where: str, file_size: int) -> int:
    """Check that every element has its own bytes in a storage within the file.

    Returns the storage's size in bytes. The test is on the strides alone, before
    anything is copied: sorted by stride, each dimension must step past everything
    the smaller ones reach, which no expanded (stride 0) or overlapping view does.
    """
    stored = int(tensor.untyped_storage().nbytes())
    if stored > file_size:
        raise InvalidInputError(
            f"{where} has a storage of {stored} bytes in a file of {file_size}; the file is "
            "damaged or forged, save it again"
        )
    shape, strides = tuple(tensor.shape), tuple(tensor.stride())
    if 0 in shape:
        return stored
    reach = 1  # elements spanned by the dimensions checked so far
    for stride, size in sorted((st, n) for st, n in zip(strides, shape, strict=True) if n > 1):
        if stride == 0:
            raise InvalidInputError(
                f"{where} is an expanded view (stride 0 along a dimension of {size}): its "
                f"{tensor.numel()} elements repeat {stored} bytes of storage; {_CLONE}"
            )
        if stride < reach:
            raise InvalidInputError(
                f"{where} is a view whose elements overlap in its storage (shape {list(shape)}, "
                f"strides {list(strides)}); {_CLONE}"
            )
        reach += stride * (size - 1)
    end = (tensor.storage_offset() + reach) * tensor.element_size()
    if end > stored:
        raise InvalidInputError(
            f"{where} reaches byte {end} of a storage of {stored} bytes; the file is damaged "
            "or forged, save it again"
        )
    return stored


def tensor_spec(tensor: torch.Tensor, *, path: str, name: str, file_size: int) -> TensorSpec:
    """The one validation of a torch tensor, for the header read and the whole read alike."""
    where = f"{printable(path, limit=PATH_LIMIT)}: tensor {printable(name)}"
    dtype = _dtype_name(tensor, where)
    stored = _check_view(tensor, where, file_size)
    return parse_tensor_spec(
        name, dtype, tuple(tensor.shape), None, path=path, room=stored, source="its storage"
    )


def tensor_to_numpy(tensor: torch.Tensor, spec: TensorSpec, *, path: str) -> np.ndarray:
    """The tensor as a canonical numpy array (bfloat16 as ml_dtypes'), after :func:`tensor_spec`."""
    import torch

    t = tensor.detach().contiguous()  # bounded: tensor_spec checked the view first
    bf16 = spec.dtype == "bfloat16"  # numpy has no bfloat16: move the bits through int16
    array = t.view(torch.int16).numpy().view(bfloat16()) if bf16 else t.numpy()
    check_tensor_values(spec, array, path=path)
    return array


class _Flattener:
    """Walks a loaded checkpoint, collecting tensors and plain-value metadata."""

    def __init__(self, path: str, file_size: int) -> None:
        self.path = path
        self.file_size = file_size
        self.tensors: dict[str, tuple[torch.Tensor, TensorSpec]] = {}
        self.metadata: dict[str, str] = {}
        self.claimed = 0  # bytes all tensors claim, a shared storage counted once per name

    def add(self, obj: object, key: str) -> None:
        import torch

        if isinstance(obj, torch.Tensor):
            self._claim(key)
            spec = tensor_spec(obj, path=self.path, name=key, file_size=self.file_size)
            self.claimed += spec.nbytes
            self.tensors[key] = (obj, spec)
        elif isinstance(obj, Mapping):
            for k, v in obj.items():
                if not isinstance(k, str | int):
                    raise InvalidInputError(
                        f"{printable(self.path, limit=PATH_LIMIT)}: key {printable(k)} under "
                        f"{printable(key or 'the top level')} is a "
                        f"{type(k).__name__}; only str and int keys can name tensors"
                    )
                self.add(v, f"{key}.{k}" if key else str(k))
        elif isinstance(obj, list | tuple):
            for i, v in enumerate(obj):
                self.add(v, f"{key}.{i}" if key else str(i))
        elif obj is None or isinstance(obj, str | int | float | bool):
            self._claim(key)
            self.metadata[key] = str(obj)
        else:
            raise InvalidInputError(
                f"{printable(self.path, limit=PATH_LIMIT)}: {printable(key or 'the top level')} "
                f"holds a {type(obj).__name__}; "
                f"gradpipe reads tensors, dicts, lists, tuples and plain values; {_RESAVE}"
            )

    def check_total(self) -> None:
        """Refuse a file whose tensors together claim far more than the file holds."""
        check_claimed(self.path, len(self.tensors), self.claimed, self.file_size)

    def _claim(self, key: str) -> None:
        if not key:
            raise InvalidInputError(
                f"{printable(self.path, limit=PATH_LIMIT)}: a value has an empty name; {_RESAVE}"
            )
        if key in self.tensors or key in self.metadata:
            raise InvalidInputError(
                f"{printable(self.path, limit=PATH_LIMIT)}: two entries flatten to the same name "
                f"{printable(key)} (e.g. a key "
                "'a.b' beside a nested {'a': {'b': ...}}); rename one before saving"
            )


def check_claimed(path: str, count: int, claimed: int, file_size: int) -> None:
    """Refuse ``count`` tensors of one file claiming far more bytes in total than it holds.

    Call it after :func:`tensor_spec` of every tensor and before copying any.
    """
    bound = SHARED_STORAGE_FACTOR * file_size + SHARED_STORAGE_FLOOR
    if claimed > bound:
        raise InvalidInputError(
            f"{printable(path, limit=PATH_LIMIT)}: its {count} tensors claim {claimed} bytes "
            f"({format_bytes(claimed)}) in total, more than {bound} bytes ({SHARED_STORAGE_FACTOR} "
            f"x the file's {file_size} bytes + {SHARED_STORAGE_FLOOR}): many names refer to the "
            "same storage. Save each tensor once, or call .clone() on the tensors that must stay "
            "separate before torch.save"
        )


def _check_archive(f: IO[bytes] | str, *, path: str, size: int, data: bool) -> None:
    """Refuse a zip-format file whose records torch would inflate, over-read or read damaged.

    torch.save writes every record uncompressed, but torch.load inflates a
    deflated one to whatever size the zip directory declares, before gradpipe
    sees a tensor: a small file could take gigabytes. The records must also fit
    in the file together: a forged directory listing one storage under many
    names would make torch read it once per name. And torch.load checks no
    CRC-32, so each record's is checked here (``data``: the storage records
    too, else only the small ones, the pickle and its companions), reading it
    through once; a record whose CRC-32 is 0 has none (``torch.save`` with
    ``torch.serialization.set_crc32_options(False)`` writes 0). Files that are
    not zip archives are left to torch.load.
    """
    with contextlib.ExitStack() as stack:
        file = stack.enter_context(Path(f).open("rb")) if isinstance(f, str) else f
        file.seek(0)
        if file.read(4) != b"PK\x03\x04":
            file.seek(0)
            return
        try:
            archive = stack.enter_context(zipfile.ZipFile(file))
        except (zipfile.BadZipFile, ValueError, EOFError):
            file.seek(0)
            return  # torch.load reports the damage in its own words
        records = archive.infolist()
        for info in records:
            if info.compress_type != zipfile.ZIP_STORED or info.file_size != info.compress_size:
                raise InvalidInputError(
                    f"{printable(path, limit=PATH_LIMIT)}: record {printable(info.filename)} is "
                    f"compressed ({info.file_size} bytes "
                    f"declared from {info.compress_size}); torch.save writes uncompressed "
                    f"records, so the file was altered; {_RESAVE}"
                )
        total = sum(info.file_size for info in records)
        if total > size:
            raise InvalidInputError(
                f"{printable(path, limit=PATH_LIMIT)}: its {len(records)} records declare {total} "
                "bytes in total in a file "
                f"of {size}: the zip directory lists the same bytes under several names; the "
                "file is damaged or forged, save it again"
            )
        for info in records:
            if info.CRC and (data or not _is_storage(info.filename)):
                _check_record(archive, info, path)
        file.seek(0)


def _is_storage(name: str) -> bool:
    """Whether a record holds a storage's bytes (``<archive>/data/<key>``)."""
    return posixpath.basename(posixpath.dirname(name)) == "data"


def _check_record(archive: zipfile.ZipFile, info: zipfile.ZipInfo, path: str) -> None:
    """Read a record through: zipfile compares its CRC-32 at the end."""
    try:
        with archive.open(info) as record:
            while record.read(_CRC_PIECE):
                pass
    except (zipfile.BadZipFile, EOFError, ValueError) as exc:
        raise damaged(
            path,
            f"record {printable(info.filename)}",
            f" ({reason(exc)})",
            remedy="save it again",
        ) from None


def load_checkpoint(f: IO[bytes] | str, *, path: str, size: int, data: bool = True) -> object:
    """Load a ``torch.save`` file safely: refuse altered archives, unpickle weights only.

    Every record's CRC-32 is checked first; ``data=False`` checks only the
    small records (the pickle and its companions), for a caller that reads no
    tensor values (a header read), so a memory-mapped file is not read through.
    Tensors still need :func:`tensor_spec` (views that repeat storage), :func:`check_claimed`
    (names sharing storage) and :func:`tensor_to_numpy`, in that order.
    """
    _check_archive(f, path=path, size=size, data=data)
    return _load(f, path)


def _flatten(
    f: IO[bytes] | str, *, path: str, stem: str, size: int, data: bool = True
) -> _Flattener:
    obj = load_checkpoint(f, path=path, size=size, data=data)
    flat = _Flattener(path, size)
    import torch

    if isinstance(obj, torch.Tensor):
        flat.add(obj, stem)
    elif isinstance(obj, Mapping | list | tuple):
        flat.add(obj, "")
    else:
        raise InvalidInputError(
            f"{printable(path, limit=PATH_LIMIT)}: holds a {type(obj).__name__}, not tensors; save "
            "a dict of tensors "
            "(a state_dict) instead"
        )
    flat.check_total()  # before any tensor is copied
    return flat


def _size(f: IO[bytes] | str) -> int:
    if isinstance(f, str):
        return Path(f).stat().st_size
    size = f.seek(0, os.SEEK_END)
    f.seek(0)
    return size


def load_torch(
    f: IO[bytes] | str, *, path: str, stem: str
) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Load a PyTorch file as flat ``(tensors, metadata)``.

    Parameters
    ----------
    f : binary file object or local file name
        A file object must be seekable. A local file name is memory-mapped
        where torch can (zip-format files).
    path : str
        Name of the file, for error messages.
    stem : str
        Name given to the tensor of a file that holds a single tensor.

    Returns
    -------
    tensors : dict of str to numpy.ndarray
        C-contiguous little-endian arrays (bfloat16 as ``ml_dtypes.bfloat16``) in
        the checkpoint's order; they may share memory with each other when the
        tensors shared a storage.
    metadata : dict of str to str
        Plain-value leaves, as ``str(value)``.

    Raises
    ------
    InvalidInputError
        If torch is missing, the file is damaged, would need unsafe unpickling,
        holds something other than tensors and plain values, or a tensor is a
        view whose elements repeat its storage (expanded, stride 0, overlapping).
    """
    flat = _flatten(f, path=path, stem=stem, size=_size(f))
    tensors = {k: tensor_to_numpy(t, spec, path=path) for k, (t, spec) in flat.tensors.items()}
    return tensors, flat.metadata


def _stem(path: str) -> str:
    return posixpath.splitext(posixpath.basename(path))[0]


class TorchReader:
    """The dump reader of ``torch.save`` files (``.pt``, ``.pth``)."""

    format = "torch"
    # torch reads the whole file; a local one is memory-mapped instead.
    partial_header = False

    def _flatten(self, source: DumpSource, *, data: bool) -> _Flattener:
        source.file.seek(0)
        # A local file is memory-mapped (through the descriptor that was checked to
        # be a regular file): its header costs no data read.
        target: IO[bytes] | str = source.local_path or source.file
        return _flatten(
            target, path=source.path, stem=_stem(source.path), size=source.size, data=data
        )

    def parse_header(self, source: DumpSource) -> tuple[tuple[TensorSpec, ...], dict[str, str]]:
        """Every tensor's spec (nothing is copied) and the plain-value leaves.

        Storage records are not read (their CRC-32s are checked when tensors are).
        """
        flat = self._flatten(source, data=False)
        return tuple(spec for _, spec in flat.tensors.values()), flat.metadata

    def read_tensors(
        self, source: DumpSource, specs: Mapping[str, TensorSpec]
    ) -> dict[str, np.ndarray]:
        """The tensors named in ``specs``, validated as the header was (every CRC-32 too)."""
        flat = self._flatten(source, data=True)
        return {
            name: tensor_to_numpy(tensor, spec, path=source.path)
            for name, (tensor, spec) in flat.tensors.items()
            if name in specs
        }


#: The reader :data:`gradpipe.formats.registry.READERS` names.
READER = TorchReader()
