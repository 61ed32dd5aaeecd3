"""llama.cpp's perplexity on a GGUF file's weights dequantized to F32: the bench's reference for ours.

llama.cpp quantizes the activations of its quantized products to 8 bits (Q8_0, Q8_1 or Q8_K blocks); ours take them
as float32 unless asked otherwise. On the same file the two perplexities then differ by what int8 activations move
(about 2 % on gemma3:270m's Q4_K_M file), which says nothing about either engine's arithmetic. On a copy of the file
whose every tensor is the F32 value of the original's (``gguf.quants.dequantize``, the reference dequantizer of the
format's own Python package), llama.cpp's products are float ones: its perplexity there is the one ours must match.

The copy is written into a temporary folder and removed after the measurement; it takes 4 bytes a weight, so it is
made only where that fits (:data:`MAX_COPY_BYTES`, and the temporary folder's free space).
"""

from __future__ import annotations

import math
import shutil
import tempfile
from pathlib import Path
from collections.abc import Iterator
from typing import Any, Callable, Optional

import numpy as np

MAX_COPY_BYTES = 4 << 30  # the largest F32 copy made (a 1B-parameter model)
SPARE_BYTES = 1 << 30  # free space left in the temporary folder after the copy


def float_copy_bytes(path: Path) -> int:
    """Bytes of the tensors of ``path``'s F32 copy (4 a weight).

    Raises:
        ValueError: ``path`` is not a readable GGUF file (gguf's reader says why).
    """
    import gguf

    return sum(4 * int(t.n_elements) for t in gguf.GGUFReader(path).tensors)


def dequantized(reader) -> Iterator[tuple[Any, np.ndarray]]:
    """``(tensor, values)`` for each tensor of a ``gguf.GGUFReader``, in file order: its values dequantized to
    float32 by ``gguf.quants.dequantize``, NumPy shape (GGUF lists the fastest axis first). One at a time.

    Raises:
        NotImplementedError: gguf cannot dequantize a tensor's type.
    """
    import gguf

    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        yield t, np.ascontiguousarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32).reshape(shape)


def write_float_copy(src: Path, dst: Path) -> None:
    """Write ``dst``: the GGUF file ``src`` with every tensor dequantized to F32 (``gguf.quants.dequantize``) and
    ``general.file_type`` 0 (all F32); every other metadata field as ``src`` has it. One tensor is held in memory at
    a time.

    Raises:
        NotImplementedError: gguf cannot dequantize one of ``src``'s tensor types.
        ValueError, OSError: ``src`` cannot be read, or ``dst`` written.
    """
    import gguf

    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(dst, reader.fields[gguf.Keys.General.ARCHITECTURE].contents())
    try:
        for field in reader.fields.values():
            if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
                continue  # written by the writer itself
            kind = field.types[0]
            value = 0 if field.name == gguf.Keys.General.FILE_TYPE else field.contents()
            writer.add_key_value(field.name, value, kind,
                                 sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
        for t in reader.tensors:
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # GGUF lists the fastest axis first
            writer.add_tensor_info(t.name, shape, np.dtype(np.float32), 4 * math.prod(shape),
                                   raw_dtype=gguf.GGMLQuantizationType.F32)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for _, values in dequantized(reader):
            writer.write_tensor_data(values)
    finally:
        writer.close()


def float_reference_perplexity(perplexity: Callable[[str], float], path: Path,
                               say: Callable[[str], None] = lambda _m: None) -> tuple[Optional[float], str]:
    """``perplexity(copy)`` on an F32 copy of the GGUF file ``path`` made for it (and removed after), and a line
    saying what was measured; ``(None, why)`` where no copy was made (too large for :data:`MAX_COPY_BYTES` or the
    temporary folder's free space, or a tensor type gguf cannot dequantize). Errors of ``perplexity`` itself
    propagate."""
    try:
        need = float_copy_bytes(path)
    except (ValueError, OSError) as e:
        return None, f"not measured: {path.name} cannot be read for an F32 copy ({e})"
    gib = need / 2**30
    if need > MAX_COPY_BYTES:
        return None, f"not measured: the F32 copy would take {gib:.1f} GiB (at most {MAX_COPY_BYTES / 2**30:.0f})"
    with tempfile.TemporaryDirectory(prefix="mlx-engine-f32-") as tmp:
        free = shutil.disk_usage(tmp).free
        if free < need + SPARE_BYTES:
            return None, (f"not measured: the F32 copy would take {gib:.1f} GiB and the temporary folder has "
                          f"{free / 2**30:.1f} GiB free")
        copy = Path(tmp) / (path.stem + "-f32.gguf")
        say(f"writing an F32 copy of {path.name} ({gib:.1f} GiB) for llama.cpp's float perplexity")
        try:
            write_float_copy(path, copy)
        except NotImplementedError as e:
            return None, f"not measured: gguf cannot dequantize {path.name} ({e})"
        return perplexity(str(copy)), "measured on an F32 copy of the file's weights (gguf.quants.dequantize)"


def describe(value: Optional[float], note: str, ours: float) -> str:
    """The bench table's line for the reference: its value beside ours, or why there is none."""
    head = "llama.cpp's perplexity on the file's weights dequantized to F32 (its products then take float activations)"
    if value is None:
        return f"{head}: {note}"
    return f"{head}: {value:.4f}; ours {ours:.4f} ({ours / value:.4f}x)"


__all__ = ["MAX_COPY_BYTES", "dequantized", "describe", "float_copy_bytes", "float_reference_perplexity",
           "write_float_copy"]
