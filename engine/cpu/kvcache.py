"""A growable float32 K/V cache for the NumPy backend (the CUDA backend preallocates instead)."""

from __future__ import annotations

import numpy as np

_GROW = 256  # positions added per growth step, so a long generation reallocates rarely


class KVCache:
    """k (n_layers, capacity, n_kv_heads, head_dim) f32, v (n_layers, capacity, n_kv_heads, value_dim) f32."""

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, value_dim: int, limit: int):
        self.limit = limit  # the most positions this cache may ever hold
        self.k = np.zeros((n_layers, 0, n_kv_heads, head_dim), np.float32)
        self.v = np.zeros((n_layers, 0, n_kv_heads, value_dim), np.float32)

    def reserve(self, n_positions: int) -> None:
        """Make room for positions 0..n_positions-1 (the caller has checked n_positions <= limit)."""
        cap = self.k.shape[1]
        if n_positions <= cap:
            return
        new_cap = min(self.limit, max(n_positions, cap + _GROW))
        for name in ("k", "v"):
            old = getattr(self, name)
            grown = np.zeros((old.shape[0], new_cap, *old.shape[2:]), np.float32)
            grown[:, :cap] = old
            setattr(self, name, grown)

    def snapshot(self) -> None:
        # Entries are indexed by position, so going back to a position needs no saved data: later writes to
        # positions past it are simply overwritten or never read. Caches with recurrent state return a copy here.
        return None

    def restore(self, state: None) -> None:
        pass

    def write(self, layer: int, start: int, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Store k/v of positions start..start+n-1 and return views of positions 0..start+n-1."""
        end = start + k.shape[0]
        self.k[layer, start:end] = k
        self.v[layer, start:end] = v
        return self.k[layer, :end], self.v[layer, :end]
