"""Writing the GGUF files tests build (with the ``gguf`` package's writer)."""

from __future__ import annotations

from typing import Any


def finish_gguf(writer: Any) -> None:
    """A `gguf.GGUFWriter` whose metadata and tensors are added, written out in the file's order and closed."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
