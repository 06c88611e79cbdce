"""The worker's arrangement with the Runpod SDK, pinned to the version in pyproject.toml: what the job loop imports
(engine/worker/serverless.py keeps the CLI, the API client, S3 upload, SSH and the local test server off the cold
path), that the deferred parts still work when asked for, and the SDK internals the worker builds on. An SDK upgrade
that changes any of it fails here first, naming what moved."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys

from tests.worker_support import ROOT

# What `import runpod.serverless` loads of the SDK with the deferral in place (runpod 1.12.0).
JOB_LOOP_MODULES = {
    "runpod", "runpod.agent", "runpod.cli", "runpod.cli.groups", "runpod.cli.groups.config",
    "runpod.cli.groups.config.functions", "runpod.http_client", "runpod.serverless", "runpod.serverless.modules",
    "runpod.serverless.modules.rp_fitness", "runpod.serverless.modules.rp_handler", "runpod.serverless.modules.rp_http",
    "runpod.serverless.modules.rp_job", "runpod.serverless.modules.rp_local", "runpod.serverless.modules.rp_logger",
    "runpod.serverless.modules.rp_ping", "runpod.serverless.modules.rp_progress", "runpod.serverless.modules.rp_scale",
    "runpod.serverless.modules.rp_tips", "runpod.serverless.modules.worker_state", "runpod.serverless.utils",
    "runpod.serverless.utils.rp_debugger", "runpod.serverless.utils.rp_volume_cache", "runpod.serverless.worker",
    "runpod.user_agent", "runpod.version",
}  # fmt: skip
# Never on the cold path: the SDK's CLI and SSH, its GraphQL/endpoint clients, S3, the dev server, py-cpuinfo.
KEPT_OFF = ["paramiko", "invoke", "boto3", "botocore", "fastapi", "uvicorn", "runpod.api.ctl_commands",
            "runpod.endpoint", "runpod.cli.groups.ssh", "runpod.serverless.modules.rp_fastapi",
            "runpod.serverless.utils.rp_upload", "runpod.serverless.utils.rp_download"]  # fmt: skip

PROBE = """
import json, sys
from engine.worker import serverless
with serverless._cheap_cpuinfo():
    runpod = serverless.import_job_loop()
loaded = sorted(m for m in sys.modules if m == "runpod" or m.startswith("runpod."))
off = [m for m in %r if m in sys.modules]
cpuinfo = "cpuinfo" in sys.modules
late = {"create_endpoint": callable(runpod.create_endpoint), "version": runpod.__version__,
        "upload": callable(runpod.serverless.utils.upload_file_to_bucket),
        "stop_event": hasattr(runpod.cli, "STOP_EVENT")}
print(json.dumps({"loaded": loaded, "off": off, "cpuinfo": cpuinfo, "late": late}))
"""


def pinned_version() -> str:
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        return re.search(r'"runpod==([^"]+)"', f.read()).group(1)


def test_the_installed_sdk_is_the_pinned_one():
    assert importlib.metadata.version("runpod") == pinned_version() == "1.12.0", (
        "the SDK changed: re-check engine/worker/serverless.py against it, then update this test's module lists"
    )


def test_the_job_loop_imports_only_what_it_needs_and_the_rest_still_works_later():
    p = subprocess.run([sys.executable, "-c", PROBE % KEPT_OFF], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert set(got["loaded"]) == JOB_LOOP_MODULES, {"new": sorted(set(got["loaded"]) - JOB_LOOP_MODULES),
                                                     "gone": sorted(JOB_LOOP_MODULES - set(got["loaded"]))}  # fmt: skip
    assert got["off"] == [] and got["cpuinfo"] is False
    assert got["late"] == {"create_endpoint": True, "version": pinned_version(), "upload": True, "stop_event": True}


def test_the_sdk_internals_the_worker_builds_on():
    import runpod.serverless
    from runpod.serverless.modules import rp_fastapi, rp_job, rp_scale

    for name in ("start", "register_fitness_check"):
        assert callable(getattr(runpod.serverless, name)), name
    # the cancel route: the dev server's class, its job list, the two routes that run a stored job
    assert all(hasattr(rp_fastapi.WorkerAPI, m) for m in ("_sim_status", "_sim_stream", "start_uvicorn"))
    assert hasattr(rp_fastapi, "job_list") and hasattr(rp_fastapi.job_list, "get")
    # a cancel from the platform cancels the job's task (what the async handler relies on)
    assert hasattr(rp_scale.JobScaler, "stop_job") and hasattr(rp_job, "run_job_generator")
    # the stand-in cpuinfo covers the one import of py-cpuinfo on the loop's path
    with open(rp_job.__file__.replace("modules/rp_job.py", "utils/rp_debugger.py")) as f:
        assert "import cpuinfo" in f.read()
