"""Per-sequence caches of the NumPy backend: growable arrays (the CUDA backend preallocates instead). K/V and latent
rows are float32, or float16 under KV_CACHE_TYPE=f16 (engine/cache_type.py: rounded when written, widened when
read, as the CUDA kernels do); the recurrent state is always float32.

`KVCache` holds attention keys/values, `LatentCache` MLA's compressed rows, `HybridCache` a KVCache for the
attention layers plus the recurrent state (conv windows and delta-rule matrices) of the Gated DeltaNet layers.
All share one protocol: `reserve(n)`, `reset()`, `snapshot()` / `restore(state)`, and for state files
(engine/state.py) `STATE_LAYOUT`, `state_spec(n)`, `state_arrays(n)`, `load_state(arrays, n, positional)`:
"positional" arrays are indexed by position (K/V, latent rows) and stay valid under later tokens, the others
(conv, ssm) are overwritten by every token.
"""

from __future__ import annotations

import numpy as np

from engine import cache_type

_GROW = 256  # positions added per growth step, so a long generation reallocates rarely


def _grown(old: np.ndarray, n_positions: int, limit: int) -> np.ndarray | None:
    """`old` (n_layers, capacity, ...) widened along axis 1 to hold n_positions, or None when it already does."""
    cap = old.shape[1]
    if n_positions <= cap:
        return None
    new_cap = min(limit, max(n_positions, cap + _GROW))
    grown = np.zeros((old.shape[0], new_cap, *old.shape[2:]), old.dtype)
    grown[:, :cap] = old
    return grown


def _spec(arrays: dict[str, np.ndarray], n: int, positional: tuple[str, ...]) -> list[tuple[str, str, tuple]]:
    """(name, dtype, shape) of each array as a state file holds it after n positions."""
    return [(k, a.dtype.str[1:], (a.shape[0], n, *a.shape[2:]) if k in positional else a.shape)
            for k, a in arrays.items()]  # fmt: skip


class KVCache:
    """k (n_layers, capacity, n_kv_heads, head_dim), v (n_layers, capacity, n_kv_heads, value_dim) of `dtype` ("f4"
    or "f2": engine/cache_type.py)."""

    # In a state file: k (n_layers, n, n_kv_heads, head_dim), v (n_layers, n, n_kv_heads, value_dim), "kv-f32/1" or
    # "kv-f16/1" by the element. The CUDA dense model keeps the same rows, so a state moves between the backends.

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, value_dim: int, limit: int, dtype: str = "f4"):
        self.limit = limit  # the most positions this cache may ever hold
        self.STATE_LAYOUT = cache_type.layout("kv", dtype)
        self.k = np.zeros((n_layers, 0, n_kv_heads, head_dim), dtype)
        self.v = np.zeros((n_layers, 0, n_kv_heads, value_dim), dtype)

    def reserve(self, n_positions: int) -> None:
        """Make room for positions 0..n_positions-1 (the caller has checked n_positions <= limit)."""
        for name in ("k", "v"):
            grown = _grown(getattr(self, name), n_positions, self.limit)
            if grown is not None:
                setattr(self, name, grown)

    def reset(self) -> None:
        pass  # positions past the sequence are never read, so a new sequence simply overwrites them

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

    def state_spec(self, n: int) -> list[tuple[str, str, tuple]]:
        return _spec({"k": self.k, "v": self.v}, n, ("k", "v"))

    def state_arrays(self, n: int) -> dict[str, np.ndarray]:
        return {"k": self.k[:, :n], "v": self.v[:, :n]}

    def load_state(self, arrays: dict[str, np.ndarray], n: int, positional: bool = True) -> None:
        if positional:
            self.reserve(n)
            self.k[:, :n] = arrays["k"]
            self.v[:, :n] = arrays["v"]


class LatentCache:
    """MLA keeps one row per position and layer: rows (n_layers, capacity, kv_lora_rank + rope_dim) of `dtype`, the
    normalised KV latent followed by the roped k_pe. Keys are whole rows, values their first kv_lora_rank dims.
    Like K/V the rows are indexed by position, so reset, snapshot and restore have nothing to do."""

    def __init__(self, n_layers: int, row_dim: int, limit: int, dtype: str = "f4"):
        self.limit = limit
        self.STATE_LAYOUT = cache_type.layout("latent", dtype)  # rows (n_layers, n, kv_lora_rank + rope_dim)
        self.rows = np.zeros((n_layers, 0, row_dim), dtype)

    def reserve(self, n_positions: int) -> None:
        grown = _grown(self.rows, n_positions, self.limit)
        if grown is not None:
            self.rows = grown

    def reset(self) -> None:
        pass

    def snapshot(self) -> None:
        return None

    def restore(self, state: None) -> None:
        pass

    def write(self, layer: int, start: int, rows: np.ndarray) -> np.ndarray:
        """Store rows (n, row_dim) of positions start..start+n-1 and return a view of positions 0..start+n-1."""
        end = start + rows.shape[0]
        self.rows[layer, start:end] = rows
        return self.rows[layer, :end]

    def state_spec(self, n: int) -> list[tuple[str, str, tuple]]:
        return _spec({"rows": self.rows}, n, ("rows",))

    def state_arrays(self, n: int) -> dict[str, np.ndarray]:
        return {"rows": self.rows[:, :n]}

    def load_state(self, arrays: dict[str, np.ndarray], n: int, positional: bool = True) -> None:
        if positional:
            self.reserve(n)
            self.rows[:, :n] = arrays["rows"]


class HybridCache:
    """Attention layers' K/V plus the recurrent state of the Gated DeltaNet layers.

    conv (n_recurrent, conv_kernel - 1, conv_dim) f32: the last K-1 inputs of the causal conv, oldest first.
    ssm (n_recurrent, n_v_heads, head_k_dim, head_v_dim) f32: the delta-rule state matrix S of every v head.
    Unlike K/V these are overwritten by each token, so going back to an earlier position needs a saved copy.
    """

    # k, v of the attention layers as in KVCache; conv (n_recurrent, conv_kernel - 1, conv_dim) f32 and
    # ssm (n_recurrent, n_v_heads, head_k_dim, head_v_dim) f32 after the last position. "hybrid-f32/1" or
    # "hybrid-f16/1" by the K/V element.

    def __init__(self, kv: KVCache, n_recurrent: int, conv_shape: tuple[int, int], ssm_shape: tuple[int, int, int]):
        self.kv = kv
        self.STATE_LAYOUT = cache_type.layout("hybrid", kv.k.dtype.str[1:])
        self.conv = np.zeros((n_recurrent, *conv_shape), np.float32)
        self.ssm = np.zeros((n_recurrent, *ssm_shape), np.float32)

    @property
    def limit(self) -> int:
        return self.kv.limit

    def reserve(self, n_positions: int) -> None:
        self.kv.reserve(n_positions)

    def write(self, layer: int, start: int, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self.kv.write(layer, start, k, v)

    def reset(self) -> None:
        """A new sequence starts from zero state."""
        self.conv.fill(0.0)
        self.ssm.fill(0.0)

    def snapshot(self) -> tuple[np.ndarray, np.ndarray]:
        return self.conv.copy(), self.ssm.copy()

    def restore(self, state: tuple[np.ndarray, np.ndarray]) -> None:
        # Copy in rather than adopt the arrays: the same snapshot may be restored again later.
        conv, ssm = state
        np.copyto(self.conv, conv)
        np.copyto(self.ssm, ssm)

    def state_spec(self, n: int) -> list[tuple[str, str, tuple]]:
        return self.kv.state_spec(n) + _spec({"conv": self.conv, "ssm": self.ssm}, n, ())

    def state_arrays(self, n: int) -> dict[str, np.ndarray]:
        return {**self.kv.state_arrays(n), "conv": self.conv, "ssm": self.ssm}

    def load_state(self, arrays: dict[str, np.ndarray], n: int, positional: bool = True) -> None:
        self.kv.load_state(arrays, n, positional)
        np.copyto(self.conv, arrays["conv"])
        np.copyto(self.ssm, arrays["ssm"])
