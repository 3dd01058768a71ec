"""The import layers (scripts/check_layers.py): the project's imports point down the stack, and
the check finds an import that points up, a circle of files and a circle of packages."""

import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
from check_layers import LAYERS, ROOTS, violations  # noqa: E402


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A copy of the project's Python sources, to break."""
    for top in ROOTS:
        shutil.copytree(
            ROOT / top, tmp_path / top, ignore=shutil.ignore_patterns("drafters", "data")
        )
    return tmp_path


def add_line(path: Path, line: str) -> None:
    path.write_text(path.read_text() + f"\n{line}\n")


def test_the_project_imports_point_down():
    assert violations(ROOT) == []
    assert [prefix for prefix, _ in LAYERS][0] == "workers.layers"  # kernels at the bottom
    assert [prefix for prefix, _ in LAYERS][-1] == "deployments"


def test_an_import_pointing_up_is_found(tree):
    assert violations(tree) == []
    add_line(tree / "workers/layers/kv_cache.py", "from deployments.config import ServeConfig")
    lazy = "def f():\n    from speculative.engine.request import Request"
    add_line(tree / "speculative/sampling.py", lazy)
    errors = violations(tree)
    assert any(e.startswith("workers/layers/kv_cache.py:") and "above it" in e for e in errors)
    assert any(
        e.startswith("speculative/sampling.py:") and "speculative.engine" in e for e in errors
    )


def test_a_circle_of_files_is_found(tree):
    # verify.py imports sampling.py: one layer, so only the circle is wrong
    add_line(tree / "speculative/sampling.py", "import speculative.verify")
    errors = violations(tree)
    assert errors == ["files import each other: speculative.sampling -> speculative.verify"]


def test_a_circle_of_packages_is_found(tree):
    """Two packages in one layer that use each other through different files."""
    for name, line in (("a/x.py", "import workers.b.y"), ("b/z.py", "from workers.a import w")):
        package = tree / "workers" / name.split("/")[0]
        package.mkdir(exist_ok=True)
        for module in ("__init__.py", "w.py", "x.py", "y.py", "z.py"):
            (package / module).touch()
        add_line(tree / "workers" / name, line)
    assert violations(tree) == ["packages import each other: workers.a -> workers.b"]


def tracked_files() -> list[Path]:
    import subprocess

    names = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout
    return [ROOT / name for name in names.split()]


def test_source_files_stay_small_and_name_no_outside_folder():
    """No source file (tests aside) over 300 lines; no file names the folder beside the checkout
    (what the repository needs, it holds)."""
    long, outside = [], []
    for path in tracked_files():
        if path.suffix == ".py" and "tests" not in path.parts:
            if len(path.read_text().splitlines()) > 300:
                long.append(path.name)
        if path.suffix in (".py", ".sh", ".md", ".yaml", ".toml", ".txt", ""):
            if path.is_file() and "../" + "shared" in path.read_text(errors="replace"):
                outside.append(path.name)
    assert not long, long
    assert not outside, outside
