"""Training-state files: what ``gradpipe snapshot`` reads and ``gradpipe restore`` writes.

======================  ===========  ==============================================
extension               kind         state
======================  ===========  ==============================================
``.safetensors``        safetensors  flat ``{name: array}``; ``__metadata__`` kept
``.npz``                npz          flat ``{name: array}``
``.npy``                npy          ``{file stem: array}``
``.pt``, ``.pth``       torch        the checkpoint's nesting, tensors as arrays
======================  ===========  ==============================================

Reading goes through the dump readers, so a state file is validated exactly
as a gradient dump is (sizes bounded by the file, dtypes gradpipe stores, no
unpickling of npy objects). A torch checkpoint (``{"model": model.state_dict(),
"optimizer": optimizer.state_dict(), "epoch": 3}``) is loaded with the same
safety rules as a torch dump (:func:`gradpipe.formats.torch.load_checkpoint`:
weights only, no compressed records, no views repeating storage, a bound on
names sharing one storage) but keeps its nesting, its int keys, tuples such as
Adam's ``betas``, ``OrderedDict`` and its ``_metadata``.

:func:`write_state_file` writes the same kind back: a safetensors file with the
same names and metadata (in the file's order, so a file made by the
``safetensors`` package comes back byte for byte), npz and npy with the same
arrays, or ``torch.save`` of the nested state with torch tensors. torch is
imported only for torch files.
"""

from __future__ import annotations

import os
import posixpath
import zipfile
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import IO, Any, Final

import fsspec
import numpy as np
from numpy.lib import format as npformat

from gradpipe.core.display import PATH_LIMIT, printable, printable_text
from gradpipe.core.dtypes import dtype_name
from gradpipe.core.state import flatten_state
from gradpipe.errors import InvalidInputError
from gradpipe.formats._output import write_output
from gradpipe.formats.dump import dump_format, open_regular
from gradpipe.formats.registry import DUMP_FORMATS, DumpSource, get_reader
from gradpipe.formats.safetensors import write_safetensors

__all__ = [
    "KINDS",
    "STATE_FILE_KEY",
    "StateFileInfo",
    "check_state_path",
    "check_torch",
    "from_torch",
    "read_state_file",
    "to_torch",
    "write_state_file",
]

#: The snapshot metadata key that remembers what kind of file a state came from.
STATE_FILE_KEY: Final = "gradpipe.state-file"

#: The kinds of state file, by the name :class:`StateFileInfo` records.
KINDS: Final = ("safetensors", "npz", "npy", "torch")
_LOCAL: Final = fsspec.filesystem("file")
_FLAT_HINT: Final = "write nested state to a .pt file instead"


@dataclass(frozen=True)
class StateFileInfo:
    """What kind of file a state came from, so it can be written back the same way.

    Attributes
    ----------
    kind : str
        ``"safetensors"``, ``"npz"``, ``"npy"`` or ``"torch"``.
    metadata : dict of str to str
        The file's own metadata (a safetensors ``__metadata__``), in file order.
    """

    kind: str
    metadata: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidInputError(
                f"unknown state file kind {printable(self.kind)}; expected one of "
                f"{', '.join(KINDS)}"
            )
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in self.metadata.items()):
            raise InvalidInputError("state file metadata must map str to str")

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form; metadata as pairs, so canonical JSON keeps the file's order."""
        return {"kind": self.kind, "metadata": [[k, v] for k, v in self.metadata.items()]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StateFileInfo:
        """Inverse of :meth:`to_dict` (``InvalidInputError``, a ``ValueError``, if malformed)."""
        if not isinstance(data, Mapping) or set(data) != {"kind", "metadata"}:
            raise InvalidInputError(f"not a state file info: {printable(data)}")
        pairs = data["metadata"]
        if not isinstance(pairs, list) or not all(
            isinstance(p, list) and len(p) == 2 for p in pairs
        ):
            raise InvalidInputError(
                f"state file info metadata is not a list of pairs: {printable(pairs)}"
            )
        metadata = dict(map(tuple, pairs))
        if len(metadata) != len(pairs):
            raise InvalidInputError("state file info metadata repeats a key")
        return cls(data["kind"], metadata)


def read_state_file(path: str | os.PathLike[str]) -> tuple[dict[Any, Any], StateFileInfo]:
    """Read a local state file: its state and how to write it back.

    Raises
    ------
    InvalidInputError
        If the extension is unknown, the file is not a regular file, is damaged
        or unsafe (see the module docstring), or holds something a snapshot
        cannot keep; the message names the file.
    OSError
        If the file cannot be opened (``FileNotFoundError``).
    """
    name = os.fspath(path)
    kind = dump_format(name)
    metadata: dict[str, str] = {}
    with open_regular(_LOCAL, name) as f:
        size = f.seek(0, os.SEEK_END)
        f.seek(0)
        if kind == "torch":
            state = _read_torch(f, name, size)
        else:
            reader = get_reader(kind)
            source = DumpSource(f, name, size, None)
            specs, metadata = reader.parse_header(source)
            arrays = reader.read_tensors(source, {s.name: s for s in specs})
            state = {s.name: arrays[s.name] for s in specs}
    # Refuse now, naming the file, what a snapshot cannot keep; the name is escaped but not
    # quoted, as it leads "FILE['key']".
    flatten_state(state, where=printable_text(name, limit=PATH_LIMIT))
    return state, StateFileInfo(kind, dict(metadata) if kind == "safetensors" else {})


def check_state_path(path: str | os.PathLike[str], info: StateFileInfo) -> None:
    """Refuse a path whose extension names another kind of file than ``info``'s."""
    name = os.fspath(path)
    ext = posixpath.splitext(name)[1].lower()
    if ext in DUMP_FORMATS and DUMP_FORMATS[ext] != info.kind:
        raise InvalidInputError(
            f"{name}: the state was read from a {info.kind} file; write it to a file ending "
            f"in {', '.join(e for e, k in DUMP_FORMATS.items() if k == info.kind)}"
        )


def write_state_file(
    path: str | os.PathLike[str] | IO[bytes], state: Mapping[Any, Any], info: StateFileInfo
) -> None:
    """Write ``state`` as a file of ``info.kind`` (atomically, for a local path).

    safetensors, npz and npy need a flat ``{str: array}`` state (npy exactly
    one array; npz and npy no bfloat16, which ``.npy`` cannot describe).

    Raises
    ------
    InvalidInputError
        If the path's extension names another kind, or the state does not fit the kind.
    """
    if isinstance(path, str | os.PathLike):
        check_state_path(path, info)
    if info.kind == "torch":
        obj = to_torch(state)

        def save(f: IO[bytes]) -> None:
            import torch

            torch.save(obj, f)

        write_output(path, save, None)
        return
    arrays = _flat_arrays(state, info.kind)
    if info.kind == "safetensors":
        write_safetensors(path, arrays, info.metadata, keep_metadata_order=True)
        return
    _refuse_bfloat16(arrays, info.kind)
    if info.kind == "npy":
        if len(arrays) != 1:
            raise InvalidInputError(
                f"a .npy file holds one array; the state has {len(arrays)}: write .npz instead"
            )
        (arr,) = arrays.values()
        write_output(path, lambda f: npformat.write_array(f, arr, allow_pickle=False), None)
        return

    def write_npz(f: IO[bytes]) -> None:
        # As np.savez writes it (stored members), without its keyword-argument names.
        with zipfile.ZipFile(f, "w", zipfile.ZIP_STORED, allowZip64=True) as zf:
            for key, arr in arrays.items():
                with zf.open(f"{key}.npy", "w", force_zip64=True) as member:
                    npformat.write_array(member, arr, allow_pickle=False)

    write_output(path, write_npz, None)


def _flat_arrays(state: Mapping[Any, Any], kind: str) -> dict[str, np.ndarray]:
    bad = next(
        ((k, v) for k, v in state.items() if type(k) is not str or type(v) is not np.ndarray),
        None,
    )
    if bad is not None:
        raise InvalidInputError(
            f"a {kind} file holds named arrays only; entry {printable(bad[0])} is a "
            f"{type(bad[1]).__qualname__}: {_FLAT_HINT}"
        )
    return dict(state)


def _refuse_bfloat16(arrays: Mapping[str, np.ndarray], kind: str) -> None:
    for key, arr in arrays.items():
        if dtype_name(arr.dtype) == "bfloat16":
            raise InvalidInputError(
                f"array {printable(key)} is bfloat16, which a .{kind} file cannot describe "
                "(np.save writes raw 2-byte records); write .safetensors or .pt instead"
            )


def _read_torch(f: IO[bytes], path: str, size: int) -> dict[Any, Any]:
    from gradpipe.formats.torch import load_checkpoint

    obj = load_checkpoint(f, path=path, size=size)
    if not isinstance(obj, dict):
        raise InvalidInputError(
            f"{printable(path, limit=PATH_LIMIT)}: holds a {type(obj).__name__}; a state file is a "
            "dict, e.g. "
            f"torch.save({{'model': model.state_dict(), 'optimizer': opt.state_dict()}}, path)"
        )
    state: dict[Any, Any] = from_torch(obj, path=path, file_size=size)
    return state


def check_torch(obj: Any, *, path: str = "state") -> None:
    """Refuse what :func:`from_torch` would refuse, without copying a byte.

    For a caller that copies the tensors elsewhere first (``save_state``
    stages them in host buffers): a sparse, quantized or meta tensor, or a view
    repeating its storage, is refused as it is, never densified by the copy.
    """
    _TorchWalk(path, None).walk(obj, ())


def from_torch(obj: Any, *, path: str = "state", file_size: int | None = None) -> Any:
    """A copy of a nested structure with every torch tensor as a numpy array.

    Containers keep their types (dict, OrderedDict with its attributes, list,
    tuple); other leaves are returned as they are. Tensors are validated as
    the torch dump reader validates them (dense, a dtype gradpipe stores, no
    view repeating its storage); with ``file_size`` (a loaded file's size),
    the total they claim and the number of objects visited are bounded by it,
    so a small forged file cannot make gradpipe build gigabytes.
    """
    from gradpipe.formats import torch as torch_format

    walker = _TorchWalk(path, file_size)
    walker.walk(obj, ())  # validate everything before a byte is copied
    if file_size is not None:
        torch_format.check_claimed(path, walker.count, walker.claimed, file_size)
    walker.convert, walker.nodes = True, 0  # the bound is per walk
    return walker.walk(obj, ())


class _TorchWalk:
    def __init__(self, path: str, file_size: int | None) -> None:
        self.path, self.file_size = path, file_size
        self.convert = False
        self.count = self.claimed = self.nodes = 0
        self.active: set[int] = set()
        # Each object costs at least a byte of pickle: more visits means shared objects.
        self.max_nodes = None if file_size is None else 4 * file_size + 1024

    def walk(self, obj: Any, path: tuple[object, ...]) -> Any:
        import torch

        from gradpipe.formats import torch as torch_format

        self.nodes += 1
        if self.max_nodes is not None and self.nodes > self.max_nodes:
            raise InvalidInputError(
                f"{printable(self.path, limit=PATH_LIMIT)}: the checkpoint refers to the same "
                "objects over and over (more "
                f"than {self.max_nodes} visits); save plain, unshared containers"
            )
        if isinstance(obj, torch.Tensor):
            # Keys come from the file: each escaped and short, the whole bounded, the cut shown.
            name = printable_text("".join(f"[{printable(k)}]" for k in path), limit=1000) or "[]"
            spec = torch_format.tensor_spec(
                obj, path=self.path, name=name, file_size=self.file_size or 2**62
            )
            if not self.convert:
                self.count, self.claimed = self.count + 1, self.claimed + spec.nbytes
                return obj
            return torch_format.tensor_to_numpy(obj, spec, path=self.path)
        if type(obj) not in (dict, OrderedDict, list, tuple):
            return obj
        if id(obj) in self.active:
            raise InvalidInputError(
                f"{printable(self.path, limit=PATH_LIMIT)}: the state contains itself at "
                f"{printable(list(path), limit=PATH_LIMIT)}"
            )
        self.active.add(id(obj))
        try:
            if isinstance(obj, list | tuple):
                return type(obj)(self.walk(v, (*path, i)) for i, v in enumerate(obj))
            out = type(obj)((k, self.walk(v, (*path, k))) for k, v in obj.items())
            for attr, value in vars(obj).items() if type(obj) is OrderedDict else ():
                setattr(out, attr, self.walk(value, (*path, attr)))
            return out
        finally:
            self.active.discard(id(obj))


def to_torch(state: Any) -> Any:
    """A copy of a nested state with every numpy array as a torch tensor (own memory).

    numpy scalars are refused: ``torch.load(weights_only=True)`` would refuse the file.
    """
    import torch

    from gradpipe.core.dtypes import bfloat16

    if isinstance(state, np.ndarray):
        if state.dtype == bfloat16():
            return torch.from_numpy(state.view(np.int16).copy()).view(torch.bfloat16)
        return torch.from_numpy(state.copy())
    if isinstance(state, np.generic):
        raise InvalidInputError(
            f"a numpy scalar ({state.dtype} {printable(state)}) cannot go into a torch checkpoint "
            "that loads with weights_only=True; write .safetensors, or make it a Python number"
        )
    if type(state) in (list, tuple):
        return type(state)(to_torch(v) for v in state)
    if type(state) in (dict, OrderedDict):
        out = type(state)((k, to_torch(v)) for k, v in state.items())
        for attr, value in vars(state).items() if type(state) is OrderedDict else ():
            setattr(out, attr, to_torch(value))
        return out
    return state
