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
"""

from __future__ import annotations

import pickle
from collections.abc import Mapping
from typing import IO, TYPE_CHECKING, Final

import numpy as np

from gradpipe.core.dtypes import bfloat16
from gradpipe.errors import InvalidInputError

if TYPE_CHECKING:
    import torch

__all__ = ["load_torch"]

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
            f"{path}: reading PyTorch files needs torch; install it with "
            "pip install 'gradpipe[torch]'"
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
                f"{path}: refused for safety: loading it would need arbitrary unpickling "
                f"({reason}), which can run code from the file; {_RESAVE}"
            ) from None
        raise InvalidInputError(
            f"{path}: not a readable PyTorch file ({reason}): it is damaged, not written "
            f"by torch.save, or would need unsafe unpickling; {_RESAVE}"
        ) from None
    except Exception as exc:  # torch raises about anything on a corrupt file
        raise InvalidInputError(
            f"{path}: not a readable PyTorch file ({type(exc).__name__}: {_summary(exc)}); "
            "check that it was written by torch.save and copied completely"
        ) from None


def _to_numpy(tensor: torch.Tensor, *, path: str, name: str) -> np.ndarray:
    import torch

    where = f"{path}: tensor {name!r}"
    if tensor.layout != torch.strided or tensor.is_quantized:
        raise InvalidInputError(
            f"{where} is a {tensor.layout} / quantized tensor; dump dense tensors "
            "(tensor.to_dense(), tensor.dequantize())"
        )
    t = tensor.detach().contiguous()
    dtype = str(t.dtype)
    if dtype == "torch.bfloat16":
        return t.view(torch.int16).numpy().view(bfloat16())
    if dtype not in _NUMPY_DTYPES:
        raise InvalidInputError(
            f"{where} has dtype {dtype}, which gradpipe does not store; convert it "
            "(e.g. tensor.float()) before saving"
        )
    return t.numpy()


class _Flattener:
    """Walks a loaded checkpoint, collecting tensors and plain-value metadata."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.tensors: dict[str, np.ndarray] = {}
        self.metadata: dict[str, str] = {}

    def add(self, obj: object, key: str) -> None:
        import torch

        if isinstance(obj, torch.Tensor):
            self._claim(key)
            self.tensors[key] = _to_numpy(obj, path=self.path, name=key)
        elif isinstance(obj, Mapping):
            for k, v in obj.items():
                if not isinstance(k, str | int):
                    raise InvalidInputError(
                        f"{self.path}: key {k!r} under {key or 'the top level'!r} is a "
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
                f"{self.path}: {key or 'the top level'!r} holds a {type(obj).__name__}; "
                f"gradpipe reads tensors, dicts, lists, tuples and plain values; {_RESAVE}"
            )

    def _claim(self, key: str) -> None:
        if not key:
            raise InvalidInputError(f"{self.path}: a value has an empty name; {_RESAVE}")
        if key in self.tensors or key in self.metadata:
            raise InvalidInputError(
                f"{self.path}: two entries flatten to the same name {key!r} (e.g. a key "
                "'a.b' beside a nested {'a': {'b': ...}}); rename one before saving"
            )


def load_torch(
    f: IO[bytes] | str, *, path: str, stem: str
) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Load a PyTorch file as flat ``(tensors, metadata)``.

    Parameters
    ----------
    f : binary file object or local file name
        A file object must be seekable, positioned at the start. A local file
        name is memory-mapped where torch can (zip-format files): tensors are
        then read only when their data is touched, so reading just the names,
        dtypes and shapes costs next to nothing.
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
        or holds something other than tensors and plain values.
    """
    obj = _load(f, path)
    flat = _Flattener(path)
    import torch

    if isinstance(obj, torch.Tensor):
        flat.add(obj, stem)
    elif isinstance(obj, Mapping | list | tuple):
        flat.add(obj, "")
    else:
        raise InvalidInputError(
            f"{path}: holds a {type(obj).__name__}, not tensors; save a dict of tensors "
            "(a state_dict) instead"
        )
    return flat.tensors, flat.metadata
