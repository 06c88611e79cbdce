"""LoRA on the NumPy backend: an adapted weight computes x·Wᵀ + scale · (x·Aᵀ)·Bᵀ, in llama.cpp's order (base
product, then B·(A·x), scaled, then added), next to the unchanged dequantized base.

`LoraWeight` stands in for the float32 matrix (out, in) (or expert stack (E, out, in)) in a model's layer dict, so
the family code's `h @ L[name].T` and `L[name][e]` work unchanged: NumPy hands `h @ w.T` to `__rmatmul__` because
the class opts out of ufuncs (`__array_ufunc__ = None`).
"""

from __future__ import annotations

import numpy as np

from engine.cpu.dequant import dequantize
from engine.lora import Adapter, LoraTensor, updates


class LoraWeight:
    """base (out, in) or (E, out, in) f32; updates [(a (rank, in) | (E, rank, in), b (out, rank) | (E, out, rank),
    scale)]."""

    __array_ufunc__ = None

    def __init__(self, base: np.ndarray, pairs: list[tuple[np.ndarray, np.ndarray, float]]):
        self.base = base
        self.pairs = pairs
        self.shape = base.shape
        self.ndim = base.ndim

    @property
    def T(self) -> _Transposed:
        return _Transposed(self)

    def __getitem__(self, index) -> LoraWeight:
        """Expert e of a stack (index an int), or a subset of output rows of a matrix (an index array)."""
        if self.ndim == 3:
            return LoraWeight(self.base[index], [(a[index], b[index], s) for a, b, s in self.pairs])
        return LoraWeight(self.base[index], [(a, b[index], s) for a, b, s in self.pairs])

    def __matmul__(self, x: np.ndarray) -> np.ndarray:
        """W·x for x (in,) or (in, n)."""
        y = self.base @ x
        for a, b, s in self.pairs:
            y = y + np.float32(s) * (b @ (a @ x))
        return y

    def row_dots(self, h: np.ndarray) -> np.ndarray:
        """h (n, in) with this matrix's n rows: out[j] = W[j]·h[j] (the LM head's per-row gathered logits)."""
        y = np.einsum("nd,nd->n", h, self.base)
        for a, b, s in self.pairs:
            y = y + np.float32(s) * np.einsum("nr,nr->n", h @ a.T, b)
        return y


class _Transposed:
    __array_ufunc__ = None

    def __init__(self, w: LoraWeight):
        self.w = w

    def __rmatmul__(self, x: np.ndarray) -> np.ndarray:
        """x (n, in) · Wᵀ -> (n, out)."""
        y = x @ self.w.base.T
        for a, b, s in self.w.pairs:
            y = y + np.float32(s) * ((x @ a.T) @ b.T)
        return y


def row_dots(head, h: np.ndarray) -> np.ndarray:
    """out[j] = head[j]·h[j] for a plain (n, dim) array or a LoraWeight."""
    if isinstance(head, LoraWeight):
        return head.row_dots(h)
    return np.einsum("nd,nd->n", h, head)


def _f32(t: LoraTensor) -> tuple[np.ndarray, np.ndarray]:
    a = dequantize(t.a.data, t.a.ggml_type, t.a.shape)
    b = dequantize(t.b.data, t.b.ggml_type, t.b.shape)
    return a, b


def attach(model, adapters: list[Adapter]) -> int:
    """Wrap every adapted weight of a CpuModel (`model.layers[i][name]`, `model.output`) in a LoraWeight.

    The adapters were checked against the file (engine/lora.py), so every target exists. Returns how many
    weights were wrapped."""
    by_target = updates(adapters)
    for ts in by_target.values():
        pairs = [(*_f32(t), t.scale) for t in ts]
        first = ts[0]
        if first.layer is None:  # "output": the runner's LM head
            model.output = LoraWeight(model.output, pairs)
        else:
            layer = model.layers[first.layer]
            layer[first.short] = LoraWeight(layer[first.short], pairs)
    return len(by_target)
