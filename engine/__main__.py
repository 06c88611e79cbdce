"""python -m engine ...: see engine/tools/cli.py."""

import sys

from engine.cuda import prestart_cli

# The CUDA context takes a few hundred milliseconds to create: start it on a thread before anything heavy is
# imported, for the commands that load a model; once it exists, the same thread uploads the model's weights (from
# its prepare cache's data offset) while this one imports and opens the model.
prestart_cli(sys.argv)

from engine.tools.cli import main  # noqa: E402

sys.exit(main())
