"""The statistics of one generation request (:class:`GenerationStats`), filled by the runner's loops and the
server's scheduler."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["GenerationStats"]


@dataclass
class GenerationStats:
    """Statistics of one request. Rates in tokens per second, times in seconds, memory in bytes.

    ``prompt_tokens`` counts the whole prompt; ``prefilled_tokens`` those actually run (the rest came from the cache).
    ``stop_reason`` is ``eos``, ``stop`` (a stop string), ``length`` (``max_tokens`` or the context is full) or
    ``interrupted`` (the caller stopped reading). With speculative decoding: ``verify_steps`` (forward passes that
    verified a draft), ``draft_proposed`` and ``draft_accepted`` (draft tokens). ``context_full``: the answer was cut off because the context (the
    KV cache's capacity for the sequence) was full, not by ``max_tokens``. ``format_complete``: with a response
    format, whether the text is a complete value of it (False: cut off inside it); None without one.
    """

    prompt_tokens: int = 0
    prefilled_tokens: int = 0
    prompt_tps: float = 0.0
    generated_tokens: int = 0
    decode_tps: float = 0.0
    ttft_s: float = 0.0
    peak_memory_bytes: int = 0
    stop_reason: str = ""
    context_full: bool = False
    format_complete: bool | None = None
    verify_steps: int = 0
    draft_proposed: int = 0
    draft_accepted: int = 0

    def summary(self) -> str:
        """One line: prompt and decode speed, time to first token, peak memory; with speculative decoding, the
        share of draft tokens accepted and the tokens each verification step gave."""
        spec = ""
        if self.verify_steps:
            rate = self.draft_accepted / self.draft_proposed if self.draft_proposed else 0.0
            spec = (f" | speculative: {self.draft_accepted}/{self.draft_proposed} draft tokens accepted "
                    f"({rate:.0%}), {(self.generated_tokens - 1) / self.verify_steps:.2f} tokens per step")
        return (f"prompt: {self.prompt_tokens} tokens ({self.prefilled_tokens} prefilled) at "
                f"{self.prompt_tps:.1f} tok/s | decode: {self.generated_tokens} tokens at {self.decode_tps:.1f} tok/s"
                f" | time to first token: {self.ttft_s * 1000:.0f} ms | peak memory: "
                f"{self.peak_memory_bytes / 2**20:.1f} MiB | stop: {self.stop_reason}{spec}")
