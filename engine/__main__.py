"""python -m engine ...: see engine/tools/cli.py."""

import sys

from engine.cuda import prestart


def _requested_backend(argv: list[str]) -> str | None:
    for i, arg in enumerate(argv):
        if arg.startswith("--backend="):
            return arg.split("=", 1)[1]
        if arg == "--backend" and i + 1 < len(argv):
            return argv[i + 1]
    return None


# The CUDA context takes a few hundred milliseconds to create: start it on a thread before anything heavy is
# imported, for the commands that load a model (prestart skips the CPU backend and machines with nothing built).
if len(sys.argv) > 1 and sys.argv[1] in ("system1", "generate", "check", "bench", "profile"):
    prestart(_requested_backend(sys.argv))

from engine.tools.cli import main  # noqa: E402

sys.exit(main())
