"""Element types of the ``ml`` interfaces (:class:`DType`, re-exported by ``mlx_engine.ml``): the one thing of ours
that the interfaces, the weights readers and the backends all name."""

from __future__ import annotations

import enum


class DType(enum.Enum):
    """Element types. ``itemsize`` is in bytes."""

    FLOAT32 = "float32"
    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"
    INT64 = "int64"
    INT32 = "int32"
    UINT32 = "uint32"
    INT8 = "int8"
    UINT8 = "uint8"
    BOOL = "bool"

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self]

    @property
    def is_floating(self) -> bool:
        return self in (DType.FLOAT32, DType.FLOAT16, DType.BFLOAT16)

    @classmethod
    def parse(cls, name: "str | DType") -> "DType":
        """``DType.parse("fp16")`` -> ``DType.FLOAT16``. Raises ``ValueError`` naming the accepted spellings."""
        if isinstance(name, DType):
            return name
        key = str(name).lower().strip()
        key = _ALIASES.get(key, key)
        try:
            return cls(key)
        except ValueError:
            raise ValueError(
                f"unknown dtype {name!r}; use one of {', '.join(d.value for d in cls)} (or f32, f16, bf16)"
            ) from None


_ITEMSIZE = {
    DType.FLOAT32: 4, DType.FLOAT16: 2, DType.BFLOAT16: 2, DType.INT64: 8, DType.INT32: 4, DType.UINT32: 4,
    DType.INT8: 1, DType.UINT8: 1, DType.BOOL: 1,
}
_ALIASES = {"f32": "float32", "fp32": "float32", "f16": "float16", "fp16": "float16", "half": "float16",
            "bf16": "bfloat16", "i32": "int32", "i64": "int64"}
