"""Call a live Runpod endpoint running this worker: run, runsync, status, stream, cancel, health through the
Runpod SDK's endpoint client (`runpod.endpoint.runner.RunPodClient`: its session, auth header and retries), and
`chat` through the `openai` package against the endpoint's OpenAI-compatible route.

    export RUNPOD_API_KEY=...
    python serverless/client.py runsync ENDPOINT_ID --prompt "The capital of France is" --candidate " Paris" \\
        --candidate " London"                                      # a system1 job
    python serverless/client.py runsync ENDPOINT_ID --prompt "Once upon a time" --max-tokens 32
    python serverless/client.py stream ENDPOINT_ID --prompt "Once upon a time" --max-tokens 64   # prints as it comes
    python serverless/client.py run ENDPOINT_ID --input '{"openai_route": "/v1/models"}'       # then: status ID
    python serverless/client.py status ENDPOINT_ID JOB_ID
    python serverless/client.py cancel ENDPOINT_ID JOB_ID
    python serverless/client.py health ENDPOINT_ID
    python serverless/client.py chat ENDPOINT_ID --prompt "Say hello" --max-tokens 16 [--stream]   # openai package

Prints the job's output as JSON on stdout; on stderr: the platform's delayTime/executionTime, the client's round
trip, the request timings and, on a worker's first job, its cold-start breakdown. Exit 1 when the job failed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

API = os.environ.get("RUNPOD_API_BASE", "https://api.runpod.ai/v2")
FINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMED_OUT"}


def _key() -> str:
    key = os.environ.get("RUNPOD_API_KEY")
    if not key:
        raise SystemExit("set RUNPOD_API_KEY")
    return key


def sdk_client():
    """The SDK's endpoint client, pointed at API (RUNPOD_API_BASE: a stand-in of the platform, in tests)."""
    from runpod.endpoint.runner import RunPodClient

    client = RunPodClient(api_key=_key())
    client.endpoint_url_base = API
    return client


def call(endpoint: str, path: str, body: dict | None = None, timeout: float = 330.0) -> dict:
    """One queue-API request (POST with a body, else GET), the platform's whole answer (delayTime included,
    which the SDK's Endpoint.run_sync drops)."""
    import requests

    client = sdk_client()
    try:
        if body is None and not path.startswith("cancel/"):
            return client.get(f"{endpoint}/{path}", timeout=timeout)
        return client.post(f"{endpoint}/{path}", body, timeout=timeout)
    except requests.HTTPError as e:
        text = e.response.text[:500] if e.response is not None else ""
        raise SystemExit(f"HTTP {getattr(e.response, 'status_code', '?')} from {path}: {text}") from None


def wait(endpoint: str, job: dict, poll_s: float = 0.5, limit_s: float = 900.0) -> dict:
    """Poll /status until the job is final."""
    deadline = time.monotonic() + limit_s
    while job.get("status") not in FINAL:
        if time.monotonic() > deadline:
            raise SystemExit(f"job {job.get('id')} not final after {limit_s:.0f} s: {job.get('status')}")
        time.sleep(poll_s)
        job = call(endpoint, f"status/{job['id']}")
    return job


def result_of(job: dict):
    """The job's result: a generator handler's output is a list whose last element is the full result."""
    output = job.get("output")
    return output[-1] if isinstance(output, list) and output else output


def summarize(job: dict, round_trip_ms: float, print_output: bool = True) -> int:
    """Print the output (stdout) and the timing summary (stderr); 1 if the job failed."""
    if job.get("status") != "COMPLETED":
        error = job.get("error")
        with contextlib.suppress(TypeError, ValueError):
            error = json.loads(error)  # the worker's errors are JSON: {"error", "error_kind"}
        print(json.dumps({"status": job.get("status"), "error": error}, indent=1))
        return 1
    if print_output:
        print(json.dumps(job.get("output"), indent=1, ensure_ascii=False))
    summary = {k: job.get(k) for k in ("id", "delayTime", "executionTime", "workerId") if k in job}
    summary["client_round_trip_ms"] = round(round_trip_ms, 1)
    result = result_of(job)
    if isinstance(result, dict):
        summary.update({k: result[k] for k in ("finish_reason", "usage", "timings", "backend") if k in result})
        if result.get("cold_start"):
            summary["cold_start"] = result["cold_start"]
    print(json.dumps(summary, indent=1), file=sys.stderr)
    return 0


def job_input(args) -> dict:
    if args.input:
        return json.loads(args.input)
    if args.prompt is None:
        raise SystemExit("give --input JSON or --prompt")
    if args.candidate:
        return {"prompt": args.prompt, "candidates": args.candidate, "temperature": args.temperature or 1.0}
    body = {"max_tokens": args.max_tokens, "temperature": args.temperature or 0.0}
    if args.chat:
        body["messages"] = [{"role": "user", "content": args.prompt}]
    else:
        body["prompt"] = args.prompt
    return body


def stream(endpoint: str, payload: dict) -> int:
    """Submit with stream: true and print text as /stream hands it over, then the summary."""
    t0 = time.monotonic()
    if "openai_input" in payload:
        payload = {**payload, "openai_input": {**payload["openai_input"], "stream": True}}
    else:
        payload = {**payload, "stream": True}
    job = call(endpoint, "run", {"input": payload})
    first_at, status = None, job.get("status")
    while status not in FINAL:
        time.sleep(0.25)
        polled = call(endpoint, f"stream/{job['id']}")
        for item in polled.get("stream", []):
            chunk = item.get("output")
            text = chunk if isinstance(chunk, str) else None  # OpenAI routes stream server-sent-event text
            if isinstance(chunk, dict) and "finish_reason" not in chunk:  # the last element is the full result
                text = chunk.get("text")
            if text:
                first_at = first_at or time.monotonic()
                sys.stdout.write(text)
                sys.stdout.flush()
        status = polled.get("status", status)
    sys.stdout.write("\n")
    if first_at is not None:
        print(f"first text after {1000 * (first_at - t0):.0f} ms (client side, polling included)", file=sys.stderr)
    final = call(endpoint, f"status/{job['id']}")
    return summarize(final, 1000 * (time.monotonic() - t0), print_output=False)


def chat(endpoint: str, args) -> int:
    """A chat completion through the `openai` package at the endpoint's OpenAI route."""
    import openai

    client = openai.OpenAI(base_url=f"{API}/{endpoint}/openai/v1", api_key=_key(), max_retries=2)
    messages = [{"role": "user", "content": args.prompt or "Hello"}]
    params = dict(model=args.model or "default", messages=messages, max_tokens=args.max_tokens,
                  temperature=0.0 if args.temperature is None else args.temperature)  # fmt: skip
    t0 = time.monotonic()
    if args.stream:
        for chunk in client.chat.completions.create(**params, stream=True):
            if chunk.choices and chunk.choices[0].delta.content:
                sys.stdout.write(chunk.choices[0].delta.content)
                sys.stdout.flush()
        sys.stdout.write("\n")
        print(json.dumps({"client_round_trip_ms": round(1000 * (time.monotonic() - t0), 1)}), file=sys.stderr)
        return 0
    response = client.chat.completions.create(**params)
    print(response.choices[0].message.content)
    summary = {"client_round_trip_ms": round(1000 * (time.monotonic() - t0), 1), "usage": response.usage.model_dump()}
    print(json.dumps(summary), file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    for name in ("run", "runsync", "stream"):
        s = sub.add_parser(name, help=f"POST /{'run' if name == 'stream' else name}")
        s.add_argument("endpoint")
        s.add_argument("--input", help="the job input as JSON (overrides the options below)")
        s.add_argument("--prompt")
        s.add_argument("--candidate", action="append", help="a system1 candidate (repeat)")
        s.add_argument("--max-tokens", type=int, default=32)
        s.add_argument("--temperature", type=float, default=None)
        s.add_argument("--chat", action="store_true", help="send the prompt as a user message (chat template)")
        s.add_argument("--wait", action="store_true", help="run: poll /status until the job is final")
    s = sub.add_parser("status", help="GET /status/JOB_ID")
    s.add_argument("endpoint")
    s.add_argument("job_id")
    s = sub.add_parser("cancel", help="POST /cancel/JOB_ID")
    s.add_argument("endpoint")
    s.add_argument("job_id")
    s = sub.add_parser("health", help="GET /health")
    s.add_argument("endpoint")
    s = sub.add_parser("chat", help="POST /openai/v1/chat/completions with the openai package")
    s.add_argument("endpoint")
    s.add_argument("--prompt")
    s.add_argument("--model", help="the served model name (any value is answered with the served name)")
    s.add_argument("--max-tokens", type=int, default=32)
    s.add_argument("--temperature", type=float, default=None)
    s.add_argument("--stream", action="store_true")
    args = p.parse_args(argv)

    t0 = time.monotonic()
    if args.command == "health":
        print(json.dumps(call(args.endpoint, "health"), indent=1))
        return 0
    if args.command == "status":
        return summarize(call(args.endpoint, f"status/{args.job_id}"), 1000 * (time.monotonic() - t0))
    if args.command == "cancel":
        print(json.dumps(call(args.endpoint, f"cancel/{args.job_id}")))
        return 0
    if args.command == "chat":
        return chat(args.endpoint, args)
    payload = job_input(args)
    if args.command == "stream":
        return stream(args.endpoint, payload)
    if args.command == "runsync":
        job = wait(args.endpoint, call(args.endpoint, "runsync?wait=120000", {"input": payload}))
    else:
        job = call(args.endpoint, "run", {"input": payload})
        if not args.wait:
            print(json.dumps(job))
            return 0
        job = wait(args.endpoint, job)
    return summarize(job, 1000 * (time.monotonic() - t0))


if __name__ == "__main__":
    sys.exit(main())
