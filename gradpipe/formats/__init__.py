"""Readers and writers of gradient-dump file formats."""

from gradpipe.formats.dump import (
    DUMP_FORMATS,
    DumpHeader,
    TensorSpec,
    check_regular_file,
    dump_format,
    read_byte_range,
    read_dump_header,
    read_dump_tensors,
)
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
    "DUMP_FORMATS",
    "DumpHeader",
    "SafetensorsHeader",
    "TensorEntry",
    "TensorSpec",
    "check_regular_file",
    "dump_format",
    "read_byte_range",
    "read_dump_header",
    "read_dump_tensors",
    "read_header",
    "read_safetensors",
    "read_tensor",
    "read_tensor_range",
    "write_safetensors",
]
