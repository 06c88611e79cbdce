"""llama.cpp's byte-pair merge loop over one pre-tokenized word, in plain Python.

Two dicts are all it needs (token text -> id, "left right" -> merge rank), which load from the prepare cache in a
fraction of the time a compiled BPE model takes to build, and that build would otherwise hold the GIL across the
cold start. Words repeat, so results are cached per word.

The loop (llm_tokenizer_bpe_session::tokenize): the word's characters are the initial symbols; repeatedly merge
the adjacent pair with the lowest merge rank, the leftmost on a tie, whether or not the merged text is itself a
token; when no pair has a rank, each symbol becomes its token, and a symbol that is no token becomes the tokens of
its single-byte (ASCII) characters, others dropped.
"""

from __future__ import annotations

import heapq

_WORD_CACHE = 1 << 16  # distinct words remembered per tokenizer


class BytePairEncoder:
    def __init__(self, vocab: dict[str, int], ranks: dict[str, int], ignore_merges: bool):
        self.vocab = vocab  # token text (byte-level form) -> id
        self.ranks = ranks  # "left right" -> merge rank (lower merges first)
        self.ignore_merges = ignore_merges  # a word that is a token is taken whole (llama3 vocabularies)
        self.ascii = {b: vocab[chr(b)] for b in range(128) if chr(b) in vocab}
        self.cache: dict[str, list[int]] = {}

    def encode(self, words: list[str]) -> list[int]:
        out: list[int] = []
        for w in words:
            ids = self.cache.get(w)
            if ids is None:
                ids = self._word(w)
                if len(self.cache) < _WORD_CACHE:
                    self.cache[w] = ids
            out += ids
        return out

    def _word(self, word: str) -> list[int]:
        if self.ignore_merges and word in self.vocab:
            return [self.vocab[word]]
        out = []
        for sym in self.merge(word):
            i = self.vocab.get(sym)
            if i is not None:
                out.append(i)
            else:
                out += [self.ascii[b] for b in sym.encode() if b in self.ascii]
        return out

    def merge(self, word: str) -> list[str]:
        sym = list(word)  # symbol texts; "" once merged into its left neighbour
        n = len(sym)
        if n < 2:
            return sym
        nxt = [*range(1, n), -1]
        prev = list(range(-1, n - 1))
        ranks = self.ranks
        heap: list[tuple[int, int, str]] = []  # (rank, left symbol, merged text): lowest rank, then leftmost
        for i in range(n - 1):
            r = ranks.get(sym[i] + " " + sym[i + 1])
            if r is not None:
                heap.append((r, i, sym[i] + sym[i + 1]))
        heapq.heapify(heap)
        while heap:
            _, left, text = heapq.heappop(heap)
            right = nxt[left]
            # Stale: the left symbol grew or lost its right neighbour to another merge since this pair was queued.
            if right < 0 or not sym[left] or sym[left] + sym[right] != text:
                continue
            sym[left], sym[right] = text, ""
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prev[nxt[right]] = left
            for a, b in ((prev[left], left), (left, nxt[left])):
                if a >= 0 and b >= 0 and (r := ranks.get(sym[a] + " " + sym[b])) is not None:
                    heapq.heappush(heap, (r, a, sym[a] + sym[b]))
        return [s for s in sym if s]
