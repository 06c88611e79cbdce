"""The OpenAI routes' jobs (/v1/chat/completions, /v1/completions) run on the engine: prompt, structured output,
logprobs, the thinking split, and the response or its server-sent events (shapes: engine/worker/openai_api.py).
Like every job of the worker (engine/worker/service.py) this is a generator doing at most one engine step per
`next()`, yielding None for a step with nothing to send."""

from __future__ import annotations

from collections.abc import Iterator

from engine.worker import jobs, logprobs, openai_api, reasoning, structured


def chooser_for(worker, req: jobs.ChatCompletionRequest | jobs.CompletionRequest) -> logprobs.Chooser | None:
    """The host-side token chooser a request needs (a grammar, logprobs), or None: the backend samples alone."""
    grammar = structured.grammar_for(req.response_format, req.grammar)
    top = req.n_logprobs
    if grammar is None and top is None:
        return None
    where = "grammar" if req.grammar is not None else "response_format"
    constraint = structured.Constraint(worker.engine.tokenizer, grammar, where) if grammar is not None else None
    return logprobs.Chooser(worker.engine.tokenizer, top, constraint)


def answer(worker, req: jobs.ChatCompletionRequest | jobs.CompletionRequest) -> Iterator[dict | str | None]:
    engine = worker.engine
    chat = isinstance(req, jobs.ChatCompletionRequest)
    if chat:
        prompt = engine.apply_chat_template([m.for_template() for m in req.messages],
                                            **(req.chat_template_kwargs or {}))  # fmt: skip
    else:
        prompt = req.text
    chooser = chooser_for(worker, req)
    sampling = req.sampling(req.requested_max_tokens or worker.room(prompt))
    response = openai_api.Response(req.route, worker.served_name)
    s = engine.generate_stream(prompt, **sampling, chooser=chooser)
    think = chat and worker.reasoning
    opened = think and prompt.rstrip().endswith(reasoning.OPEN)  # the template opened the thinking itself
    with_logprobs = chooser is not None and chooser.top is not None

    def shaped(records: list, offset: int) -> dict | None:
        if not with_logprobs:
            return None
        return chooser.chat(records) if chat else chooser.completion(records, offset)

    if not req.stream:
        for _ in s:
            yield None
        result = s.result
        records = chooser.take(len(result["token_ids"])) if with_logprobs else []
        split = reasoning.split(result["text"], opened) if think else None
        yield response.complete(result, shaped(records, 0), split)
        return
    splitter = reasoning.ThinkSplitter(opened) if think else None
    offset = 0
    for batch in worker.stream_batches(s):
        if batch is None:
            yield None
            continue
        records = chooser.take(len(batch["token_ids"])) if with_logprobs else []
        text, thought = batch["text"], ""
        if splitter is not None:
            thought, text = splitter.push(text)
        if text or thought or records:
            yield openai_api.sse(response.chunk(text, logprobs=shaped(records, offset), reasoning=thought))
        else:
            yield None
        offset += len(batch["text"])
    if splitter is not None and any(rest := splitter.flush()):
        yield openai_api.sse(response.chunk(rest[1], reasoning=rest[0]))
    yield response.last_events(s.result, req.include_usage)
