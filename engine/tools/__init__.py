"""Command-line tools over the engine's public API: the CLI (`python -m engine`), the benchmark and the doctor."""
