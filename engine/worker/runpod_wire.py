"""What the Runpod queue worker sends and how it reads the answers, as runpod-python 1.12.0 does (its http_client,
rp_job and rp_http modules); engine/worker/job_loop.py is the loop that uses it.

Requests carry `Authorization` (~/.runpod/config.toml's default key, else RUNPOD_AI_API_KEY), the SDK's
`User-Agent`, `Content-Type: application/json`, `Accept-Encoding: gzip, deflate` and `Accept: */*`; results go out
as JSON with POST_HEADERS. `Http` is the standard library's http.client with keep-alive, one caller at a time.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import platform
import threading
import urllib.parse
import zlib
from collections.abc import Mapping

SDK_VERSION = "1.12.0"  # the SDK whose protocol this is; tests/test_job_loop.py checks the installed one against it
POLL_TIMEOUT_S = 90.0  # JobScaler's bound on a job-take or job-stop long-poll
POST_TIMEOUT_S = 600.0  # the SDK session's timeout
POST_HEADERS = {"charset": "utf-8", "Content-Type": "application/x-www-form-urlencoded"}  # rp_http._transmit's


class TooManyRequests(Exception):
    pass


def user_agent(env: Mapping[str, str]) -> str:
    """The SDK's User-Agent, less the `(via ...)` suffix it adds where it recognises a calling tool's variables."""
    ua = (f"RunPod-Python-SDK/{SDK_VERSION} ({platform.system()} {platform.release()}; {platform.machine()}) "
          f"Language/Python {platform.python_version()}")  # fmt: skip
    return f"{ua} Integration/{env['RUNPOD_UA_INTEGRATION']}" if env.get("RUNPOD_UA_INTEGRATION") else ua


def session_headers(env: Mapping[str, str]) -> dict[str, str]:
    """The headers of the SDK's aiohttp session (http_client.get_auth_header, and the Accept aiohttp adds), which
    every take, stop poll and result carries."""
    return {"Content-Type": "application/json", "Authorization": api_key(env), "User-Agent": user_agent(env),
            "Accept-Encoding": "gzip, deflate", "Accept": "*/*"}  # fmt: skip


def api_key(env: Mapping[str, str]) -> str:
    path = os.path.expanduser("~/.runpod/config.toml")  # the SDK's credentials file wins over the variable
    if os.path.exists(path):
        with contextlib.suppress(ImportError, OSError, ValueError, AttributeError):
            import tomllib

            with open(path, "rb") as f:
                return str(tomllib.load(f)["default"].get("api_key", ""))
    return env.get("RUNPOD_AI_API_KEY", "")


def with_params(url: str, params: Mapping[str, str | None]) -> str:
    """`url` with `params` added to its query, None values left out (as requests' `params=` does: the heartbeat)."""
    query = urllib.parse.urlencode({k: v for k, v in params.items() if v is not None})
    return f"{url}{'&' if '?' in url else '?'}{query}"


class Http:
    """Keep-alive connections (one per host) for one caller at a time: a lock holds back the next one."""

    def __init__(self, headers: dict[str, str]):
        self.headers = headers
        self._conns: dict[tuple[str, str], http.client.HTTPConnection] = {}
        self._lock = threading.Lock()

    def request(self, method: str, url: str, body: bytes | None = None, headers: Mapping[str, str] | None = None,
                timeout: float = POLL_TIMEOUT_S) -> tuple[int, str, bytes]:  # fmt: skip
        """(status, media type, body) of one request; a keep-alive connection the server dropped is retried once."""
        parts = urllib.parse.urlsplit(url)
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        with self._lock:
            retried = False
            while True:
                conn = self._conns.get((parts.scheme, parts.netloc))
                reused = conn is not None and conn.sock is not None
                if conn is None:
                    cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
                    conn = self._conns[(parts.scheme, parts.netloc)] = cls(parts.netloc, timeout=timeout)
                conn.timeout = timeout
                if conn.sock is not None:
                    conn.sock.settimeout(timeout)
                try:
                    conn.request(method, target, body=body, headers={**self.headers, **(headers or {})})
                    resp = conn.getresponse()
                    data = resp.read()
                except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                    conn.close()
                    if retried or not reused:
                        raise
                    retried = True
                    continue
                except BaseException:
                    conn.close()
                    raise
                if resp.getheader("Content-Encoding", "") in ("gzip", "deflate") and data:
                    data = zlib.decompress(data, 47)  # 47: a gzip or a zlib header
                media = resp.getheader("Content-Type", "application/octet-stream").split(";")[0].strip().lower()
                return resp.status, media, data


def jobs_in(status: int, media: str, body: bytes) -> list[dict]:
    """The jobs of a job-take answer (rp_job.get_job's rules)."""
    if status in (204, 400):  # no job; 400 is what FlashBoot's revived workers get
        return []
    if status == 429:
        raise TooManyRequests
    if status >= 400:
        raise OSError(f"job take answered {status}")
    if media != "application/json" or not body:
        return []
    try:
        jobs = json.loads(body)
    except ValueError:
        return []
    if isinstance(jobs, dict):
        if "id" not in jobs or "input" not in jobs:
            raise ValueError("Job has missing field(s): id or input.")
        return [jobs]
    return [j for j in jobs if isinstance(j, dict) and "id" in j] if isinstance(jobs, list) else []


def stops_in(status: int, media: str, body: bytes) -> list[str]:
    """The job ids of a job-stop answer (rp_job.get_stop_signals' rules)."""
    if status == 204:
        return []
    if status == 429:
        raise TooManyRequests
    if status >= 400:
        raise OSError(f"job stop answered {status}")
    with contextlib.suppress(ValueError):
        payload = json.loads(body) if media == "application/json" else None
        ids = payload.get("jobsToStop", []) if isinstance(payload, dict) else []
        return [i for i in ids if isinstance(i, str)] if isinstance(ids, list) else []
    return []
