"""What one forward pass processes (ollama's ``input.Batch``), shared by caches and models."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from mlx_engine.ml import Tensor


@dataclass
class Batch:
    """``N`` tokens, from one or several sequences, processed in one forward pass as ``[1, N, D]``.

    Attributes:
        inputs: token ids, int32 ``[N]`` on the host, or an INT32 Tensor ``[N]`` on the device (pipelined decode feeds
            the last sampled tokens without reading them back).
        positions: int32 ``[N]``, the position of each token in its sequence (0-based).
        sequences: int32 ``[N]``, the sequence id of each token (``0 <= id < max_sequences``).
        outputs: int32 ``[K]``, indices into the batch of the tokens whose logits are wanted (for example the last
            token of each sequence); the model returns logits ``[K, vocab]`` in that order.
        embeddings: optional float Tensor ``[N, D]`` used instead of looking ``inputs`` up (input embeddings).
        images: multimodal inputs at explicit places of the batch: ``(index, rows)`` puts an image's embedding
            rows ``[k, D]`` at batch indices ``index .. index + k - 1`` (in place of their placeholder tokens). An
            image's rows are never split across two batches. For a model that reads images through cross-attention
            (Llama 3.2 Vision) the token at ``index`` stays, and ``rows`` are the image's encoder output, which
            enters the encoder cache at that token's position.
        mrope_positions: optional int32 ``[3, N]``: each token's (time, height, width) positions for a model with
            M-RoPE (Qwen2.5-VL, ``DecoderConfig.mrope_section``), used by RoPE instead of ``positions`` (which still
            order the tokens for the cache's causal mask).
    """

    inputs: "np.ndarray | Tensor"
    positions: np.ndarray
    sequences: np.ndarray
    outputs: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    embeddings: "Tensor | None" = None
    images: list = field(default_factory=list)
    mrope_positions: "np.ndarray | None" = None

    def __post_init__(self) -> None:
        self.positions = np.asarray(self.positions, dtype=np.int32).reshape(-1)
        self.sequences = np.asarray(self.sequences, dtype=np.int32).reshape(-1)
        self.outputs = np.asarray(self.outputs, dtype=np.int32).reshape(-1)
        if isinstance(self.inputs, (list, tuple, np.ndarray)):
            self.inputs = np.asarray(self.inputs, dtype=np.int32).reshape(-1)
        if len(self.positions) != len(self.sequences):
            raise ValueError(f"batch has {len(self.positions)} positions but {len(self.sequences)} sequence ids")
        n = len(self.positions)
        if self.inputs is not None and self.inputs.shape[0] != n:
            raise ValueError(f"batch has {self.inputs.shape[0]} inputs but {n} positions")
        if self.mrope_positions is not None:
            self.mrope_positions = np.asarray(self.mrope_positions, dtype=np.int32)
            if self.mrope_positions.shape != (3, n):
                raise ValueError(f"batch has M-RoPE positions of shape {self.mrope_positions.shape} for {n} tokens")
        if len(self.outputs) and (self.outputs.min() < 0 or self.outputs.max() >= n):
            raise ValueError(f"batch outputs {self.outputs.tolist()} out of range for {n} tokens")

    def __len__(self) -> int:
        return len(self.positions)

    @classmethod
    def single(cls, tokens: "np.ndarray | list[int] | Tensor", start: int, sequence: int = 0,
               logits: str = "last") -> "Batch":
        """A batch of consecutive tokens of one sequence starting at position ``start``.

        ``logits``: ``"last"`` (the last token), ``"all"`` or ``"none"``.
        """
        n = tokens.shape[0] if isinstance(tokens, Tensor) else len(tokens)
        outputs = {"last": [n - 1], "all": list(range(n)), "none": []}[logits]
        return cls(tokens, np.arange(start, start + n, dtype=np.int32), np.full(n, sequence, np.int32), outputs)
