"""The queue worker's job loop on the standard library (engine/worker/job_loop.py) against a fake Runpod platform
(engine/tools/fake_runpod.py): in process with a stub handler, in subprocesses running handler.py on the tiny model,
and beside the SDK's own job loop (runpod 1.12.0), whose requests it must repeat: same methods, paths, query
parameters, headers and bodies. That comparison is pinned to the SDK version the loop mirrors: it skips with another
SDK installed and fails when the pinned one behaves otherwise."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading

import pytest

from engine.tools.fake_runpod import FakeRunpod, Request
from engine.worker import job_loop, runpod_wire
from tests.worker_support import ROOT, TINY, WORKER_ENV

SYSTEM1 = {"prompt": "Question: is the sky blue on a clear day? Answer:", "candidates": [" yes", " no", " maybe"]}
STREAM = {"prompt": "Hello", "max_tokens": 8, "temperature": 0.0, "stream": True}


def stub_config() -> dict:
    """A handler config like handler.py's, whose job input says what to do: `chunks` outputs (non-ASCII text, each
    after `sleep` s), then an error output (`fail`), an exception (`raise`), or refresh_worker (`refresh`)."""
    config: dict = {"return_aggregate_stream": True, "closed": []}

    async def handler(job):
        spec = job["input"]
        try:
            for i in range(spec.get("chunks", 1)):
                await asyncio.sleep(spec.get("sleep", 0))
                yield {"chunk": i, "text": "é✓"}
            if "fail" in spec:
                yield {"error": spec["fail"], "error_kind": "invalid_input"}
            if "raise" in spec:
                raise RuntimeError(spec["raise"])
            if spec.get("refresh"):
                config["refresh_worker"] = True
        finally:
            config["closed"].append(job["id"])

    config["handler"] = handler
    return config


# The stub worker in a process of its own: LOOP=sdk runs the SDK's job loop, else ours; FAIL_FITNESS=1 registers a
# failing fitness check.
STUB_WORKER = """
import os
from tests.test_job_loop import stub_config

def failing_check():
    raise RuntimeError("no GPU here")

config = stub_config()
checks = [failing_check] if os.environ.get("FAIL_FITNESS") == "1" else []
if os.environ["LOOP"] == "sdk":
    import runpod.serverless
    for check in checks:
        runpod.serverless.register_fitness_check(check)
    runpod.serverless.start(config)
else:
    from engine.worker import job_loop
    job_loop.serve(config, fitness_checks=checks)
"""

SCENARIO = [{"id": "a", "input": {"chunks": 3}}, {"id": "b", "input": {"chunks": 1, "fail": "bad input"}},
            {"id": "c", "input": {"chunks": 0, "raise": "boom"}}, {"id": "d", "input": {"chunks": 3, "sleep": 0.8}},
            {"id": "e", "input": {"chunks": 1, "refresh": True}}]  # fmt: skip


def _sdk_agent_variables() -> list[str]:
    """The variables through which the SDK adds a `(via ...)` tag to its User-Agent (cleared: ours never adds it).
    runpod/agent.py is read by path, so that this process does not import the SDK."""
    spec = importlib.util.find_spec("runpod")
    if spec is None:
        return []
    path = os.path.join(os.path.dirname(spec.origin), "agent.py")
    agent_spec = importlib.util.spec_from_file_location("_runpod_agent", path)
    module = importlib.util.module_from_spec(agent_spec)
    agent_spec.loader.exec_module(module)
    return module.known_env_vars()


def _worker_env(platform: FakeRunpod, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in _sdk_agent_variables() and not k.startswith("RUNPOD_")}
    return {**env, **platform.worker_env(), "RUNPOD_UA_INTEGRATION": "reflex-tests", "RUNPOD_LOG_LEVEL": "WARN",
            "RUNPOD_SKIP_AUTO_SYSTEM_CHECKS": "true", "RUNPOD_SKIP_GPU_CHECK": "true", "OPENBLAS_NUM_THREADS": "1",
            **extra}  # fmt: skip


def _run_stub(loop: str, jobs: list[dict], take_answers=(), timeout: float = 60.0, **extra: str):
    """(exit code, output, platform) of the stub worker run until it exits by itself (refresh_worker or failure)."""
    with FakeRunpod(jobs, take_answers=take_answers, stop_poll_s=0.3) as platform:
        proc = subprocess.run([sys.executable, "-c", STUB_WORKER], cwd=ROOT, capture_output=True, text=True,
                              env=_worker_env(platform, LOOP=loop, **extra), timeout=timeout)  # fmt: skip
    return proc.returncode, proc.stdout + proc.stderr, platform


def _headers(req: Request, *drop: str) -> dict[str, str]:
    skip = {"host", "content-length", *(d.lower() for d in drop)}
    return {k.lower(): v for k, v in req.headers.items() if k.lower() not in skip}


def _body(req: Request):
    """The body as sent (JSON text: spacing and unescaped non-ASCII count), but a handler exception's traceback, whose
    file paths and lines differ, cut to its first line."""
    text = req.body.decode()
    if "\\ntraceback: " not in text:
        return text
    body = req.json()
    head, tb = body["error"].split("\ntraceback: ", 1)
    return {**body, "error": [head, tb.splitlines()[0]]}


def _exchange(platform: FakeRunpod) -> list[tuple]:
    """The takes and posts, in order (they are sent one after another): what must match request for request."""
    return [(r.method, r.kind, r.path, r.query, _headers(r), _body(r)) for r in platform.requests
            if r.kind in ("take", "take-batch", "stream", "done")]  # fmt: skip


def _sdk_pinned() -> None:
    try:
        installed = importlib.metadata.version("runpod")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("runpod is not installed: nothing to compare the job loop with")
    if installed != runpod_wire.SDK_VERSION:
        pytest.skip(f"runpod {installed} is installed, the job loop mirrors {runpod_wire.SDK_VERSION}: re-read the "
                    "SDK's job loop, update engine/worker/job_loop.py and runpod_wire.SDK_VERSION")  # fmt: skip


# -- against the SDK ---------------------------------------------------------------------------------------------


def test_our_requests_are_the_sdks_request_for_request():
    _sdk_pinned()
    takes = (204, 400, 500)  # no job, FlashBoot's no job, an error: each is followed by another take
    runs = {loop: _run_stub(loop, SCENARIO, takes) for loop in ("sdk", "stdlib")}
    for loop, (code, out, _) in runs.items():
        assert code == 0, f"{loop} loop: exit {code} (refresh_worker ends the worker)\n{out[-3000:]}"
    sdk, ours = runs["sdk"][2], runs["stdlib"][2]
    # takes, streamed outputs and results: the same requests in the same order (X-Request-ID included, which the
    # SDK leaves on its session after a job's first post, so later takes carry it too)
    assert _exchange(ours) == _exchange(sdk)
    assert [r.kind for r in sdk.requests if r.kind in ("take", "done")][:4] == ["take"] * 4  # 3 no-jobs, then a
    assert dict(sdk.streams) == dict(ours.streams) and set(sdk.results) == set(ours.results) == set("abcde")
    assert ours.results["e"]["stopPod"] is True and ours.results["b"] == {"error": "bad input"}
    assert ours.results["a"] == {"output": [{"chunk": i, "text": "é✓"} for i in range(3)]}
    assert ours.results["c"]["error"].startswith("handler: boom \ntraceback: Traceback (most recent call last)")
    # the stop channel: same URL and headers (its X-Request-ID depends on when the poll went out)
    for kind, drop in (("stop", ("x-request-id",)), ("ping", ("user-agent", "accept-encoding", "connection"))):
        ours_seen = {(r.method, r.path, json.dumps(_headers(r, *drop), sort_keys=True)) for r in ours.of_kind(kind)}
        sdk_seen = {(r.method, r.path, json.dumps(_headers(r, *drop), sort_keys=True)) for r in sdk.of_kind(kind)}
        assert ours_seen == sdk_seen, kind
    # heartbeats: the same query while job d ran (idle ones leave job_id out: the in-process test below)
    for platform in (sdk, ours):
        queries = [r.query for r in platform.of_kind("ping")]
        assert {"gpu": ["test"], "job_id": ["d"], "runpod_version": [runpod_wire.SDK_VERSION]} in queries
        assert all(set(q) <= {"gpu", "job_id", "runpod_version"} for q in queries)


def test_a_failing_fitness_check_is_reported_as_the_sdk_reports_it():
    _sdk_pinned()
    for loop in ("sdk", "stdlib"):
        code, out, platform = _run_stub(loop, [{"id": "a", "input": {}}], FAIL_FITNESS="1")
        assert code == 1, f"{loop}: {out[-2000:]}"
        assert not platform.of_kind("take") and "a" not in platform.results, loop
        (report,) = [r for r in platform.of_kind("ping") if r.query.get("status") == ["unhealthy"]]
        assert report.query == {"gpu": ["test"], "status": ["unhealthy"], "check": ["failing_check"],
                                "reason": ["RuntimeError: no GPU here"],
                                "runpod_version": [runpod_wire.SDK_VERSION]}, loop  # fmt: skip
        assert report.headers["Authorization"] == "test-key"


# -- our loop in process -----------------------------------------------------------------------------------------


@contextlib.contextmanager
def in_process(jobs: list[dict], config: dict | None = None, after_first_job=None, **platform_args):
    """Our loop on a thread against a fake platform; yields (platform, config)."""
    config = config or stub_config()
    with FakeRunpod(jobs, stop_poll_s=0.2, **platform_args) as platform:
        env = {**platform.worker_env(), "RUNPOD_PING_INTERVAL": "1000"}
        loop = job_loop.JobLoop(config["handler"], config, env, after_first_job=after_first_job)
        thread = threading.Thread(target=loop.run, daemon=True)
        thread.start()
        try:
            yield platform, config
        finally:
            loop.stop()
            thread.join(30)
            assert not thread.is_alive(), "the job loop did not end after stop()"


def test_a_stopped_job_gets_no_result_and_the_next_job_is_answered():
    with in_process([{"id": "long", "input": {"chunks": 200, "sleep": 0.05}}]) as (platform, config):
        platform.wait_for(lambda: len(platform.streams["long"]) >= 2)
        platform.push({"id": "next", "input": {"chunks": 2}})
        platform.stop("long")  # a /cancel, or the execution timeout
        platform.wait_for(lambda: "next" in platform.results)
        assert "long" not in platform.results and len(platform.streams["long"]) < 200
        assert config["closed"][0] == "long"  # the handler's generator was closed at once
        assert platform.results["next"] == {"output": [{"chunk": 0, "text": "é✓"}, {"chunk": 1, "text": "é✓"}]}


def test_after_first_job_runs_once_when_the_first_result_is_posted():
    calls: list[list[str]] = []  # the results posted by then
    jobs = [{"id": "a", "input": {"chunks": 2}}, {"id": "b", "input": {"chunks": 1}}]
    with in_process(jobs, after_first_job=lambda: calls.append(sorted(platform.results))) as (platform, _):
        platform.wait_for(lambda: "b" in platform.results)
    assert calls == [["a"]]


@pytest.mark.parametrize(
    ("answers", "kept", "posts"),
    [((503, 502), {"a", "b"}, ["a", "a", "a", "b"]),  # a's third try goes through
     ((503, 502, 504), {"b"}, ["a", "a", "a", "b"]),  # three tries, then a is given up
     ((404,), {"b"}, ["a", "b"])],  # a 4xx is not tried again
)  # fmt: skip
def test_a_5xx_on_a_result_is_tried_twice_more_and_a_4xx_is_not(monkeypatch, answers, kept, posts):
    monkeypatch.setattr(job_loop, "POST_RETRY_WAITS_S", (0.0, 0.0))
    jobs = [{"id": j, "input": {"chunks": 0}} for j in ("a", "b")]
    with in_process(jobs, post_answers=answers) as (platform, _):
        platform.wait_for(lambda: "b" in platform.results)
    assert platform.results == {job: {"output": []} for job in kept}
    assert [r.path.rsplit("/", 1)[-1] for r in platform.of_kind("done")] == posts


def test_no_job_answers_and_a_bad_job_are_survived():
    jobs = [{"id": "a", "input": {"chunks": 1}}]
    with in_process(jobs, take_answers=(204, 400, 500, 404)) as (platform, _):
        platform.wait_for(lambda: "a" in platform.results)
        platform.push({"id": "no-input"})  # a job without `input` is refused, as the SDK refuses it
        platform.push({"id": "b", "input": {"chunks": 1}})
        platform.wait_for(lambda: "b" in platform.results)
    assert "no-input" not in platform.results and "no-input" not in platform.streams
    assert [r.query["job_in_progress"] for r in platform.of_kind("take")][:5] == [["0"]] * 5


def test_the_heartbeat_names_the_job_in_progress_and_goes_on_during_it():
    with in_process([{"id": "slow", "input": {"chunks": 5, "sleep": 0.5}}]) as (platform, _):
        platform.wait_for(lambda: "slow" in platform.results)
        done = platform.of_kind("done")[0].t
        platform.wait_for(lambda: any(p.t > done + 0.1 for p in platform.of_kind("ping")))
    pings, taken = platform.of_kind("ping"), platform.of_kind("take")[0].t
    # a ping built just before the take or the result may arrive just after it: 0.1 s margins
    during = [p for p in pings if taken + 0.1 < p.t < done - 0.1]
    assert during and all(p.query.get("job_id") == ["slow"] for p in during)
    after = [p for p in pings if p.t > done + 0.1]
    assert after and all("job_id" not in p.query for p in after)
    assert all(p.headers["Authorization"] == "test-key" for p in pings)


@pytest.mark.parametrize(
    ("status", "media", "body", "jobs"),
    [(204, "", b"", []), (400, "application/json", b"{}", []), (200, "text/plain", b'{"id": "a", "input": {}}', []),
     (200, "application/json", b"", []), (200, "application/json", b"not json", []),
     (200, "application/json", b'{"id": "a", "input": 1}', [{"id": "a", "input": 1}]),
     (200, "application/json", b'[{"id": "a", "input": 1}, {"id": "b", "input": 2}]',
      [{"id": "a", "input": 1}, {"id": "b", "input": 2}])],
)  # fmt: skip
def test_job_take_answers_are_read_as_the_sdk_reads_them(status, media, body, jobs):
    assert runpod_wire.jobs_in(status, media, body) == jobs


def test_job_take_and_stop_errors():
    with pytest.raises(runpod_wire.TooManyRequests):
        runpod_wire.jobs_in(429, "", b"")
    with pytest.raises(OSError):
        runpod_wire.jobs_in(502, "text/html", b"<html>")
    with pytest.raises(ValueError, match="missing field"):
        runpod_wire.jobs_in(200, "application/json", b'{"id": "a"}')
    assert runpod_wire.stops_in(200, "application/json", b'{"jobsToStop": ["a", 3, "b"]}') == ["a", "b"]
    assert runpod_wire.stops_in(200, "application/json", b'{"jobsToStop": "a"}') == []
    assert runpod_wire.stops_in(204, "", b"") == [] and runpod_wire.stops_in(200, "text/plain", b"x") == []
    with pytest.raises(runpod_wire.TooManyRequests):
        runpod_wire.stops_in(429, "", b"")


def test_urls_are_built_from_the_platforms_variables():
    env = {"RUNPOD_POD_ID": "w7", "RUNPOD_WEBHOOK_GET_JOB": "https://api.example/v2/ep/job-take/$ID?gpu=H200",
           "RUNPOD_WEBHOOK_POST_OUTPUT": "https://api.example/v2/ep/job-done/$RUNPOD_POD_ID/$ID?gpu=H200",
           "RUNPOD_WEBHOOK_PING": "https://api.example/v2/ep/ping/$RUNPOD_POD_ID?gpu=H200"}  # fmt: skip
    loop = job_loop.JobLoop(stub_config()["handler"], {}, env)
    assert loop.take_url == "https://api.example/v2/ep/job-take/w7?gpu=H200"
    assert loop.stop_url == "https://api.example/v2/ep/job-stop/w7?gpu=H200"
    assert loop.done_url == "https://api.example/v2/ep/job-done/w7/$ID?gpu=H200"
    assert loop.ping_url == "https://api.example/v2/ep/ping/w7?gpu=H200" and loop.ping_interval_s == 10
    assert runpod_wire.with_params(loop.ping_url, {"job_id": "a,b", "x": None}) == f"{loop.ping_url}&job_id=a%2Cb"


# -- our loop as the worker's process ----------------------------------------------------------------------------


def test_sigterm_lets_the_job_in_flight_post_its_result_then_the_worker_exits():
    with FakeRunpod([{"id": "a", "input": {"chunks": 4, "sleep": 0.3}}]) as platform:
        proc = subprocess.Popen([sys.executable, "-c", STUB_WORKER], cwd=ROOT, env=_worker_env(platform, LOOP="stdlib"),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
        try:
            platform.wait_for(lambda: platform.streams["a"], alive=lambda: proc.poll() is None)
            proc.send_signal(signal.SIGTERM)
            out = proc.communicate(timeout=30)[0]
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 0, out[-2000:]
    assert len(platform.results["a"]["output"]) == 4
    assert platform.of_kind("take")[-1].t < platform.of_kind("done")[-1].t  # no take after the signal


# handler.py as `python handler.py`, with every module the process ever imports written to the file named by argv[1]
# with the time.monotonic() it was first asked for: those loaded before it starts (at 0), then each new one as a
# finder first sees it (on every thread, import statement or importlib alike).
RECORDING_WORKER = """
import runpy, sys, time

class Recorder:
    def find_spec(self, name, path=None, target=None):
        log.write(f"{name} {time.monotonic()}\\n")
        return None  # found by the usual finders

log = open(sys.argv[1], "w", buffering=1)
log.write("".join(f"{name} 0\\n" for name in sys.modules))
sys.meta_path.insert(0, Recorder())
sys.argv = ["handler.py"]
runpy.run_path("handler.py", run_name="__main__")
"""


def _handler_worker(loop: str, jobs: list[dict], tmp_path) -> tuple[dict[str, float], FakeRunpod]:
    """handler.py on the tiny model in queue mode until it has answered `jobs`, then SIGTERM; (every module it
    imported -> when it was first asked for, platform)."""
    modules = tmp_path / f"modules-{loop}.txt"
    with FakeRunpod(jobs) as platform:
        env = _worker_env(
            platform, **{**WORKER_ENV, "MODEL_PATH": TINY, "REFLEX_BACKEND": "cpu", "REFLEX_JOB_LOOP": loop}
        )
        proc = subprocess.Popen([sys.executable, "-c", RECORDING_WORKER, str(modules)], cwd=ROOT, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
        try:
            last = jobs[-1]["id"]
            platform.wait_for(lambda: last in platform.results, 120, alive=lambda: proc.poll() is None)
            proc.send_signal(signal.SIGTERM)
            out = proc.communicate(timeout=60)[0]
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert proc.returncode == 0, out[-3000:]
    imported: dict[str, float] = {}
    for line in modules.read_text().splitlines():
        name, t = line.split()
        imported.setdefault(name, float(t))
    return imported, platform


def _answers(platform: FakeRunpod) -> dict:
    """Results and streamed outputs without their timings and cold-start records (which differ run to run)."""

    def strip(out):
        return {k: v for k, v in out.items() if k not in ("timings", "cold_start")} if isinstance(out, dict) else out

    results = {j: {**r, "output": [strip(o) for o in r["output"]]} if "output" in r else r
               for j, r in platform.results.items()}  # fmt: skip
    return {"results": results, "streams": {j: [strip(s["output"]) for s in v] for j, v in platform.streams.items()}}


QUEUE_JOBS = [{"id": "system1", "input": SYSTEM1}, {"id": "stream", "input": STREAM},
              {"id": "invalid", "input": {"prompt": 5}}]  # fmt: skip


def test_handler_queue_mode_runs_our_loop_and_never_imports_the_sdk(tmp_path):
    imported, platform = _handler_worker("stdlib", QUEUE_JOBS, tmp_path)
    assert "engine.worker.job_loop" in imported
    assert not {m for m in imported if m.split(".")[0] in ("runpod", "aiohttp", "aiohttp_retry")}, "the SDK loaded"
    (first,) = platform.results["system1"]["output"]
    assert first["best_text"] in SYSTEM1["candidates"]
    assert first["cold_start"]["job_loop"] == "stdlib" and first["cold_start"]["runpod_import_ms"] == 0
    assert first["cold_start"]["process_start_to_worker_ready_ms"] > 0
    streamed = [s["output"] for s in platform.streams["stream"]]
    assert streamed == platform.results["stream"]["output"] and len(streamed) >= 2
    assert "".join(c["text"] for c in streamed[:-1]) == streamed[-1]["text"]
    error = json.loads(platform.results["invalid"]["error"])
    assert error["error_kind"] == "invalid_input" and set(platform.results["invalid"]) == {"error"}
    # what the first (system1) job does not need waits until its result is posted
    first_result = platform.of_kind("done")[0].t
    assert imported["engine.worker.jobs"] < first_result < imported["jinja2"]
    assert imported.get("importlib.metadata", float("inf")) > first_result


def test_handler_queue_mode_answers_the_same_through_the_sdk_loop(tmp_path):
    _sdk_pinned()
    imported, sdk = _handler_worker("sdk", QUEUE_JOBS, tmp_path)
    assert {"runpod.serverless.modules.rp_scale", "aiohttp"} <= imported.keys()  # REFLEX_JOB_LOOP=sdk: its own loop
    (first,) = sdk.results["system1"]["output"]
    assert first["cold_start"]["job_loop"] == "sdk" and first["cold_start"]["runpod_import_ms"] > 0
    _, ours = _handler_worker("stdlib", QUEUE_JOBS, tmp_path)
    assert _answers(ours) == _answers(sdk)
