"""Qwen3-style thinking: the text a model writes between `<think>` and `</think>` is answered as
`reasoning_content` (vLLM's and DeepSeek's field), the rest as `content`.

On for a chat template that knows `</think>` (REASONING_PARSER=none turns it off). The opening tag may be in the
prompt (templates that start the turn with `<think>`), so everything before `</think>` counts as reasoning once the
output opens with `<think>` or the template opens it; an output that never closes its thinking is all reasoning.
`ThinkSplitter` does the same for a stream, holding back a partial tag until it is decided.
"""

from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"


def enabled(chat_template: str | None, setting: str | None) -> bool:
    if (setting or "").strip().lower() in ("none", "off", "0", "false"):
        return False
    return bool(chat_template) and CLOSE in chat_template


def split(text: str, opened_by_prompt: bool = False) -> tuple[str | None, str]:
    """(reasoning or None, content) of a whole answer."""
    s = ThinkSplitter(opened_by_prompt)
    r1, c1 = s.push(text)
    r2, c2 = s.flush()
    return (r1 + r2 if s.seen else None), c1 + c2


class ThinkSplitter:
    def __init__(self, opened_by_prompt: bool = False):
        self.state = "thinking" if opened_by_prompt else "start"  # start -> thinking -> after -> answer
        self.seen = opened_by_prompt  # any thinking at all
        self._held = ""

    def push(self, delta: str) -> tuple[str, str]:
        """(reasoning delta, content delta) for a new piece of output text."""
        text, self._held = self._held + delta, ""
        reasoning, content = "", ""
        while text:
            if self.state == "start":
                stripped = text.lstrip()
                if stripped.startswith(OPEN):
                    self.state, self.seen, text = "thinking", True, stripped[len(OPEN) :]
                elif OPEN.startswith(stripped):  # could still become the tag: decide later
                    self._held = text
                    return reasoning, content
                else:
                    self.state = "answer"
            elif self.state == "thinking":
                at = text.find(CLOSE)
                if at >= 0:
                    reasoning += text[:at]
                    self.state, text = "after", text[at + len(CLOSE) :]
                    continue
                keep = next((k for k in range(min(len(CLOSE) - 1, len(text)), 0, -1) if text.endswith(CLOSE[:k])), 0)
                reasoning += text[: len(text) - keep]
                self._held = text[len(text) - keep :]
                return reasoning, content
            elif self.state == "after":  # the newlines between the thinking and the answer belong to neither
                text = text.lstrip("\n")
                if text:
                    self.state = "answer"
            else:
                content += text
                text = ""
        return reasoning, content

    def flush(self) -> tuple[str, str]:
        held, self._held = self._held, ""
        if self.state == "thinking":
            return held, ""
        return "", held
