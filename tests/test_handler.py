"""handler.handler(job), called directly (CPU backend, tiny model): docs/design.md §4's job contract."""

from __future__ import annotations

import asyncio
import json
import sys

import pytest

from engine.errors import CudaError
from engine.worker import serverless
from engine.worker import service as worker_mod
from engine.worker.service import Worker
from tests.worker_support import TINY, handler_module, run_job, typed_error

PROMPT = "The capital of France is"
USER = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def hm():
    return handler_module()


@pytest.fixture(scope="module")
def handler(hm):
    return hm.handler


def sent(worker: Worker, job_input) -> list:
    """What `Worker.run` hands the SDK: its outputs without the None ticks between engine steps."""
    return [out for out in worker.run(job_input) if out is not None]


def one(handler, job_input) -> dict:
    out = run_job(handler, job_input)
    assert len(out) == 1 and typed_error(out[0]) is None, out
    return out[0]


def test_system1_job(handler, hm):
    r = one(handler, {"prompt": PROMPT, "candidates": [" Paris", " London", " the city of lights"], "temperature": 0.5})
    direct = hm.worker.engine.system1(PROMPT, [" Paris", " London", " the city of lights"], temperature=0.5)
    assert [c["score"] for c in r["candidates"]] == [c["score"] for c in direct["candidates"]]
    assert {"best_idx", "best_text", "entropy_bits", "timings", "cold_start", "model", "backend"} <= set(r)
    assert r["backend"] == "cpu" and r["model"]["arch"] == "qwen3"
    assert set(r["timings"]) == {"tokenize_ms", "prompt_eval_ms", "decode_ms", "tokens_per_s", "total_ms"}
    with_messages = one(handler, {"mode": "system1", "messages": USER, "candidates": [" red", " blue"]})
    assert len(with_messages["candidates"]) == 2


def test_generate_job_with_prompt_and_with_messages(handler, hm):
    r = one(handler, {"prompt": PROMPT, "max_tokens": 6})
    assert r == {**r, "finish_reason": r["finish_reason"]} and r["finish_reason"] in ("stop", "length")
    assert r["usage"] == {"prompt_tokens": 5, "completion_tokens": len(r["token_ids"])}
    assert r["text"] == hm.worker.engine.generate(PROMPT, max_tokens=6)["text"]
    chat = one(handler, {"messages": USER, "max_tokens": 4, "chat_template_kwargs": {"enable_thinking": False}})
    rendered = hm.worker.engine.apply_chat_template(USER, enable_thinking=False)
    assert chat["usage"]["prompt_tokens"] == len(hm.worker.engine.tokenizer.encode(rendered))


def test_streamed_generate_yields_growing_batches_then_the_result(handler):
    plain = one(handler, {"prompt": "Hello", "max_tokens": 16})
    out = run_job(handler, {"prompt": "Hello", "max_tokens": 16, "stream": True})
    *chunks, result = out
    assert all(set(c) == {"text", "token_ids"} for c in chunks) and typed_error(result) is None
    sizes = [len(c["token_ids"]) for c in chunks]
    assert sizes[:-1] == [1, 3, 9, 27][: len(sizes) - 1] and 0 < sizes[-1] <= [1, 3, 9, 27, 48][len(sizes) - 1]
    assert "".join(c["text"] for c in chunks) == result["text"] == plain["text"]
    assert [t for c in chunks for t in c["token_ids"]] == result["token_ids"] == plain["token_ids"]
    assert result["finish_reason"] == plain["finish_reason"]


def test_openai_chat_and_completions(handler, hm):
    body = {"messages": USER, "max_tokens": 5, "temperature": 0}
    r = one(handler, {"openai_route": "/v1/chat/completions", "openai_input": body})
    assert r["id"].startswith("chatcmpl-") and r["object"] == "chat.completion" and isinstance(r["created"], int)
    assert r["model"] == "qwen3-tiny-q8_0" and r["backend"] == "cpu" and "timings" in r
    (choice,) = r["choices"]
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] in ("stop", "length")
    native = one(handler, {"messages": USER, "max_tokens": 5})
    assert choice["message"]["content"] == native["text"]
    n_prompt, n_out = native["usage"]["prompt_tokens"], len(native["token_ids"])
    assert r["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}
    c = one(handler, {"openai_route": "/v1/completions", "openai_input": {"prompt": PROMPT, "max_tokens": 3,
                                                                          "temperature": 0.0}})  # fmt: skip
    assert c["object"] == "text_completion" and c["choices"][0]["text"] == hm.worker.engine.generate(
        PROMPT, max_tokens=3)["text"]  # fmt: skip
    models = one(handler, {"openai_route": "/v1/models"})
    assert models["object"] == "list" and models["data"][0]["id"] == "qwen3-tiny-q8_0"
    assert models["data"][0]["max_model_len"] == 256


def _events(outputs: list[str]) -> list:
    events = []
    for text in outputs:
        assert isinstance(text, str) and text.startswith("data: ") and text.endswith("\n\n"), text
        for block in text.strip().split("\n\n"):
            payload = block.removeprefix("data: ")
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def test_openai_streams_are_server_sent_events(handler):
    body = {"messages": USER, "max_tokens": 16, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    events = _events(run_job(handler, {"openai_route": "/v1/chat/completions", "openai_input": body}))
    *chunks, finish, usage, done = events
    assert done == "[DONE]" and usage["choices"] == [] and usage["usage"]["completion_tokens"] >= 1
    assert all(e["object"] == "chat.completion.chunk" for e in (*chunks, finish, usage))
    assert len({e["id"] for e in (*chunks, finish, usage)}) == 1
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert finish["choices"][0]["finish_reason"] in ("stop", "length") and "timings" in finish
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in chunks)
    body = {**body, "stream": False, "stream_options": None}
    plain = one(handler, {"openai_route": "/v1/chat/completions", "openai_input": body})
    assert text == plain["choices"][0]["message"]["content"]
    body = {"prompt": PROMPT, "max_tokens": 4, "stream": True}
    events = _events(run_job(handler, {"openai_route": "/v1/completions", "openai_input": body}))
    assert events[-1] == "[DONE]" and all(e["object"] == "text_completion" for e in events[:-1])


@pytest.mark.parametrize(
    ("job_input", "kind"),
    [
        (None, "invalid_input"),
        ("a prompt", "invalid_input"),
        ({"prompt": PROMPT, "max_tokens": 17}, "invalid_input"),
        ({"prompt": "word " * 400, "max_tokens": 8}, "context_overflow"),
        ({"prompt": "The capital of Fra", "candidates": ["nce"]}, "invalid_input"),
        ({"openai_route": "/v1/chat/completions", "openai_input": {"messages": USER, "n": 3}}, "invalid_input"),
        ({"messages": [{"role": "tool", "content": "x"}] * 2000}, "invalid_input"),
    ],
)
def test_errors_are_typed_and_the_worker_keeps_serving(handler, job_input, kind):
    (out,) = run_job(handler, job_input)
    assert typed_error(out)["error_kind"] == kind
    assert "refresh_worker" not in out
    one(handler, {"prompt": PROMPT, "candidates": [" Paris"]})


def test_a_streamed_job_that_fails_ends_with_its_error(handler, hm, monkeypatch):
    def broken(*args, **kwargs):
        yield {"text": "a", "token_ids": [1]}
        raise ValueError("boom")

    monkeypatch.setattr(hm.worker.engine, "generate_stream", lambda *a, **k: broken())
    out = run_job(handler, {"prompt": PROMPT, "stream": True})
    assert out[0] == {"text": "a", "token_ids": [1]}
    assert typed_error(out[-1]) == {"error": "ValueError: boom", "error_kind": "internal"}


def test_a_cuda_fault_recycles_the_worker(handler, hm, monkeypatch):
    def fault(*args, **kwargs):
        raise CudaError("an illegal memory access was encountered")

    monkeypatch.setattr(hm.worker.engine, "system1", fault)
    monkeypatch.delitem(hm.config, "refresh_worker", raising=False)
    (out,) = run_job(handler, {"prompt": PROMPT, "candidates": [" Paris"]})
    assert typed_error(out)["error_kind"] == "cuda" and out["refresh_worker"] is True
    assert hm.config["refresh_worker"] is True  # read by the SDK after the job: stopPod, then the worker exits


def test_an_abandoned_stream_gives_the_engine_back(handler, hm):
    async def first_then_abandon():
        gen = handler({"id": "x", "input": {"prompt": PROMPT, "max_tokens": 16, "stream": True}})
        await gen.__anext__()
        locked = hm.worker.engine._lock.locked()
        await gen.aclose()
        return locked

    assert asyncio.run(first_then_abandon())
    assert hm.engine_thread.wait_idle(10) and not hm.worker.engine._lock.locked()


def test_cold_start_is_on_the_first_result_only_with_the_worker_phases(monkeypatch):
    monkeypatch.setenv("MAX_SEQ_LEN", "64")
    w = Worker.load(TINY)
    w.boot.update(runpod_import_ms=1.0, process_start_to_worker_ready_ms=2.0)
    (err,) = sent(w, {"prompt": 1})
    assert err["error_kind"] == "invalid_input"
    (first,) = sent(w, {"prompt": PROMPT, "max_tokens": 2})
    cold = first["cold_start"]
    for key in ("imports_ms", "gguf_open_ms", "model_load_ms", "process_start_to_ready_ms", "prompt_eval_ms",
                "process_start_to_first_token_ms", "process_start_to_first_job_ms"):  # fmt: skip
        assert isinstance(cold[key], float) and cold[key] >= 0, key
    assert cold["runpod_import_ms"] == 1.0 and cold["process_start_to_worker_ready_ms"] == 2.0
    assert cold["process_start_to_first_token_ms"] >= cold["process_start_to_first_job_ms"]
    (second,) = sent(w, {"prompt": PROMPT, "candidates": [" Paris"]})
    assert second["cold_start"] is None


def test_handler_module_reports_its_boot_phases(hm):
    boot = hm.worker.boot
    assert boot["runpod_import_overlapped"] is True
    assert boot["runpod_import_ms"] > 0 and boot["runpod_import_wait_ms"] >= 0 and boot["preload_ms"] > 0
    assert boot["process_start_to_worker_ready_ms"] > 0
    assert "engine.worker.jobs" in sys.modules  # preloaded before the first job, off the serial path


@pytest.mark.parametrize("background", [True, False])
def test_background_imports_hand_over_the_sdk_or_its_error(background):
    imports = serverless.RunpodImport(background=background, preload=("json",), warm=("no_such_module_x",))
    assert imports.wait().serverless.start is not None
    assert imports.phases()["runpod_import_overlapped"] is background
    broken = serverless.RunpodImport(background=background, preload=("no_such_module_y",))
    with pytest.raises(ModuleNotFoundError):
        broken.wait()


def test_import_items_are_modules_or_functions_and_warm_ones_can_wait_for_warm_up(tmp_path, monkeypatch):
    """`module:function` imports the module and calls the function; with warm_later the warm items run only once
    warm_up() is called (the queue worker: after its first result), and settle() waits for them."""
    (tmp_path / "items_probe_mod.py").write_text("CALLS = []\n\ndef first():\n    CALLS.append('first')\n\n"
                                                 "def later():\n    CALLS.append('later')\n")  # fmt: skip
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "items_probe_mod", raising=False)
    imports = serverless.RunpodImport(preload=("items_probe_mod:first",), warm=("items_probe_mod:later", "no_such_x"),
                                      sdk=False, warm_later=True)  # fmt: skip
    imports.wait()
    imports.settle()
    calls = sys.modules["items_probe_mod"].CALLS
    assert calls == ["first"]
    imports.warm_up()
    imports.settle()
    assert calls == ["first", "later"]  # the missing module is skipped, as warm items are best effort
    imports.warm_up()  # once only
    imports.settle()
    assert calls == ["first", "later"]


def test_the_worker_builds_the_system1_schema_first_and_the_others_later():
    assert "engine.worker.jobs:build_system1" in serverless.FIRST_JOB
    assert {"engine.worker.jobs:build", "engine.worker.openai_api", "jinja2"} <= set(serverless.LATER)


@pytest.mark.parametrize(("setting", "during"), [(None, 0.0005), ("0.2", 0.0002), ("default", None), ("x", 0.0005)])
def test_the_import_thread_holds_a_short_switch_interval_and_gives_it_back(tmp_path, monkeypatch, setting, during):
    """While the import thread runs, the GIL's switch interval is REFLEX_IMPORT_SWITCH_MS (0.5 ms unless set;
    "default" leaves Python's); once the thread is done it is Python's again."""
    before = sys.getswitchinterval()
    (tmp_path / "switch_probe_mod.py").write_text("import sys\nSEEN = sys.getswitchinterval()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "switch_probe_mod", raising=False)
    if setting is None:
        monkeypatch.delenv("REFLEX_IMPORT_SWITCH_MS", raising=False)
    else:
        monkeypatch.setenv("REFLEX_IMPORT_SWITCH_MS", setting)
    imports = serverless.RunpodImport(preload=("switch_probe_mod",), sdk=False)
    imports.wait()
    imports.settle()
    seen = sys.modules["switch_probe_mod"].SEEN
    assert abs(seen - (before if during is None else during)) < 1e-9
    assert sys.getswitchinterval() == before


def test_a_model_that_does_not_load_fails_every_job_and_the_fitness_check(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    for path, kind in ((str(bad), "gguf"), (str(tmp_path / "missing.gguf"), None)):
        w = Worker.load(path)
        (out,) = sent(w, {"prompt": PROMPT})
        assert out["error_kind"] == (kind or out["error_kind"]) and out["error"]
        with pytest.raises(RuntimeError, match="the engine did not load"):
            w.check_ready()


def test_sdk_adapters():
    config = {}
    outs = list(serverless.for_runpod([{"text": "a"}, {"error": "m", "error_kind": "cuda", "refresh_worker": True},
                                       {"never": 1}], config))  # fmt: skip
    assert outs[0] == {"text": "a"} and json.loads(outs[1]["error"]) == {"error": "m", "error_kind": "cuda"}
    assert len(outs) == 2 and config["refresh_worker"] is True

    def outputs(*items):
        async def gen(job):
            for item in items:
                yield item

        return gen

    assert asyncio.run(serverless.collecting(outputs(1, 2))({})) == [1, 2]
    failing = serverless.collecting(outputs(1, {"error": "e", "error_kind": "internal"}))
    assert asyncio.run(failing({})) == {"error": "e", "error_kind": "internal"}
    local = serverless.local_test_mode
    assert local(["handler.py"], {}) and local(["h", "--test_input", "{}"], {"RUNPOD_WEBHOOK_GET_JOB": "u"})
    assert not local(["h"], {"RUNPOD_WEBHOOK_GET_JOB": "u"})
    assert not local(["h", "--rp_serve_api"], {}) and not local(["h"], {"RUNPOD_REALTIME_PORT": "8000"})


def test_the_cpuinfo_stand_in_lives_only_during_the_sdk_import(monkeypatch):
    monkeypatch.delitem(sys.modules, "cpuinfo", raising=False)
    with serverless._cheap_cpuinfo():
        import cpuinfo

        assert isinstance(cpuinfo.get_cpu_info()["brand_raw"], str)
        assert cpuinfo.get_cpu_info is serverless._cpu_info
    assert "cpuinfo" not in sys.modules


def test_batches_close_what_they_merge():
    closed = []

    def chunks():
        try:
            for i in range(100):
                yield {"text": str(i % 10), "token_ids": [i]}
        finally:
            closed.append(True)

    out = [b for b in worker_mod.batches(chunks()) if b is not None]
    assert [len(b["token_ids"]) for b in out] == [1, 3, 9, 27, 48, 12] and closed == [True]
