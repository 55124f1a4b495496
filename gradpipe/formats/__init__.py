"""Readers and writers of gradient-dump file formats."""

from gradpipe.formats.safetensors import (
    SafetensorsHeader,
    TensorEntry,
    read_header,
    read_safetensors,
    read_tensor,
    read_tensor_range,
    write_safetensors,
)

__all__ = [
    "SafetensorsHeader",
    "TensorEntry",
    "read_header",
    "read_safetensors",
    "read_tensor",
    "read_tensor_range",
    "write_safetensors",
]
