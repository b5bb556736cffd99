"""What a provider billed for one call, in one shape for both SDKs."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Usage:
    """Tokens the provider billed. ``input_tokens`` includes cached ones (Anthropic reports them
    apart; they are added back so both providers mean the same thing)."""

    input_tokens: int | None = None
    output_tokens: int | None = None
    cached_tokens: int | None = None
    # Written to the prompt cache (Anthropic bills them apart, above the input price).
    cache_write_tokens: int | None = None

    def to_json(self) -> dict[str, int | None]:
        return {"input_tokens": self.input_tokens, "output_tokens": self.output_tokens,
                "cached_tokens": self.cached_tokens,
                "cache_write_tokens": self.cache_write_tokens}
