"""Print the pinned requirements of pyproject.toml (the base dependencies plus the named extras), one per line.

The Docker image installs its Python packages from this output, so pyproject.toml stays the only list of versions:
    python scripts/pyproject_requirements.py pyproject.toml cuda worker > requirements.txt
Every requirement must be pinned with `==` (a reproducible image); anything else is an error.
"""

from __future__ import annotations

import sys

import tomllib


def requirements(pyproject: str, extras: list[str]) -> list[str]:
    with open(pyproject, "rb") as f:
        project = tomllib.load(f)["project"]
    optional = project.get("optional-dependencies", {})
    unknown = [e for e in extras if e not in optional]
    if unknown:
        raise SystemExit(f"no such extra in {pyproject}: {', '.join(unknown)}")
    reqs = list(project.get("dependencies", [])) + [r for e in extras for r in optional[e]]
    loose = [r for r in reqs if "==" not in r]
    if loose:
        raise SystemExit(f"not pinned with ==: {', '.join(loose)}")
    return reqs


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    print("\n".join(requirements(sys.argv[1], sys.argv[2:])))
