"""The generate loop as an iterator of text deltas, with EOS, stop strings and max_tokens handled in one place."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from engine.sampling import SamplingParams
from engine.timing import Stopwatch, now


def _held_back(text: str, stops: Sequence[str]) -> int:
    """How many trailing characters of `text` could still be the start of a stop string."""
    hold = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), hold, -1):
            if text.endswith(s[:k]):
                hold = k
                break
    return hold


class GenerateStream:
    """Iterate to get `{"text": delta, "token_ids": [ids]}` chunks; afterwards `.result` holds the summary.

    The text of the chunks concatenates to `result["text"]`. A stop string ends generation and is cut from the
    text together with anything after it; the end-of-generation token ends it too and is kept in the ids only.
    """

    def __init__(self, runner, tokenizer, prompt_ids: list[int], params: SamplingParams, max_tokens: int,
                 stops: Sequence[str], tokenize_ms: float, chooser=None):  # fmt: skip
        self.runner = runner
        # chooser(logits (n_vocab,) f32 on the host, params, step) -> id: set for logprobs or a grammar. It costs a
        # logits row to the host per token on CUDA, so without one the backend samples on its own (device) path.
        self.chooser = chooser
        self.tokenizer = tokenizer
        self.prompt_ids = prompt_ids
        self.params = params
        self.max_tokens = max_tokens
        self.stops = [s for s in stops if s]
        self.tokenize_ms = tokenize_ms
        self.result: dict | None = None
        self.first_token_at: float | None = None  # CLOCK_BOOTTIME seconds

    def _next(self, ids: list[int], step: int) -> int:
        """Consume `ids`, choose the next token."""
        if self.chooser is None:
            return self.runner.sample_next(ids, self.params, step)
        return self.chooser(self.runner.forward(ids, "last"), self.params, step)

    def _decode(self, tok: int, step: int) -> Iterator[int]:
        """The ids after `tok`, one per decode step, until the loop stops taking them: the backend's chained
        decode (steps queued on the device ahead of the ids read) without a chooser, else one step at a time."""
        if self.chooser is None:
            yield from self.runner.decode_chain(tok, self.params, step, self.max_tokens - step)
            return
        while True:
            tok = self._next([tok], step)
            step += 1
            yield tok

    def __iter__(self) -> Iterator[dict]:
        ids: list[int] = []
        text, emitted, pending = "", 0, []  # pending: ids not yet handed out in a chunk
        finish = "length"
        decoder = self.tokenizer.stream_decoder()
        # Only the engine's own work is timed: a consumer may take its time between chunks.
        with Stopwatch() as prompt_sw:
            tok = self._next(self.prompt_ids, 0)
        self.first_token_at = now()
        decode_ms = 0.0
        steps: Iterator[int] | None = None  # the decode steps, from the second id on
        try:
            while True:
                ids.append(tok)
                pending.append(tok)
                if tok in self.tokenizer.eog_ids:
                    finish = "stop"
                    text += decoder.flush()
                    break
                text += decoder.push(tok)
                cut = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
                if cut >= 0:
                    text, finish = text[:cut], "stop"
                    break
                if len(ids) == self.max_tokens:
                    text += decoder.flush()
                    break
                safe = len(text) - _held_back(text, self.stops)
                yield {"text": text[emitted:safe], "token_ids": pending}
                emitted, pending = max(emitted, safe), []
                t0 = now()
                if steps is None:
                    steps = self._decode(tok, len(ids))
                tok = next(steps)
                decode_ms += (now() - t0) * 1000.0
        finally:
            if steps is not None:
                steps.close()  # the position becomes that of the ids taken
        # Generation is over, so text held back as a possible stop-string prefix is final now.
        if pending or len(text) > emitted:
            yield {"text": text[emitted:], "token_ids": pending}
        n_decode = len(ids) - 1
        self.result = {
            "text": text,
            "token_ids": ids,
            "finish_reason": finish,
            "usage": {"prompt_tokens": len(self.prompt_ids), "completion_tokens": len(ids)},
            "timings": {
                "tokenize_ms": self.tokenize_ms,
                "prompt_eval_ms": prompt_sw.ms,
                "decode_ms": decode_ms,
                "tokens_per_s": n_decode / (decode_ms / 1000.0) if n_decode > 0 and decode_ms > 0 else None,
                "total_ms": self.tokenize_ms + prompt_sw.ms + decode_ms,
            },
        }
