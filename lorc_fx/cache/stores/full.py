"""A side kept in the model's dtype (no code): its window is every token."""
from __future__ import annotations

import torch


class FullStore:
    """The dynamic store of an uncoded side: ``append`` concatenates; the window holds every
    token (``(b, 1, n, r)`` latents, or ``(b, h_kv, n, d)`` keys or values kept raw)."""

    def append(self, window: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        return torch.cat([window, new], dim=-2) if window.dim() == 4 else new

    def read(self, window: torch.Tensor) -> torch.Tensor:
        return window

    def tokens(self, window: torch.Tensor) -> int:
        return window.shape[-2] if window.dim() == 4 else 0

    def cut(self, window: torch.Tensor, keep: int) -> torch.Tensor:
        return window[..., :keep, :]

    def droppable(self, window: torch.Tensor, tokens: int) -> int:
        return tokens

    def drop(self, window: torch.Tensor, tokens: int) -> torch.Tensor:
        """Drop the oldest ``tokens`` tokens; returns the window."""
        return window[..., tokens:, :] if tokens else window

    def map_batch(self, fn) -> None:
        pass

    def place_sinks(self, positions: torch.Tensor) -> None:
        pass

    def token_axes(self, window: torch.Tensor) -> list[tuple[torch.Tensor, int]]:
        return [(window, 2)] if window.dim() == 4 else []

    def tensors(self, window: torch.Tensor) -> list[torch.Tensor]:
        return [window]


class FullStaticStore:
    """The static store of an uncoded side: one buffer for ``max_cache_len`` tokens, written
    in place at the cache positions (as transformers' ``StaticLayer`` writes keys)."""

    def allocate(self, states: torch.Tensor, basis: torch.Tensor | None,
                 max_cache_len: int, ring: bool = False) -> torch.Tensor:
        return buffer(states, basis, max_cache_len)

    def write(self, window: torch.Tensor, states: torch.Tensor, positions: torch.Tensor,
              start: torch.Tensor) -> None:
        window.index_copy_(2, positions, states)

    def read(self, window: torch.Tensor) -> torch.Tensor:
        return window

    def place_sinks(self, positions: torch.Tensor) -> None:
        pass  # every token is stored alike

    def tensors(self) -> list[torch.Tensor]:
        return []


def buffer(states: torch.Tensor, basis: torch.Tensor | None, tokens: int) -> torch.Tensor:
    """Zeros for ``tokens`` tokens of one side: ``(b, 1, tokens, r)`` latents, or
    ``(b, h_kv, tokens, d)`` for a side kept raw (the two sides of a layer can differ)."""
    b, h, _, d = states.shape
    heads, width = (h, d) if basis is None else (1, basis.shape[0])
    return states.new_zeros(b, heads, tokens, width)
