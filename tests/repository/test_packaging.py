"""What ``pip install`` puts on a user's machine: the wheel built from pyproject.toml holds the package and nothing
else (not convert_scripts/, benchmarks/ or tests/), its version is ``difftransformer.__version__``, it carries the MIT
license, and every console script and plugin entry point names a function that exists. The changelog has a section
for the version."""

import configparser
import email
import importlib
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

import difftransformer

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = pytest.importorskip("tomli", reason="reading pyproject.toml needs tomllib (Python 3.11) or tomli")

REPO = Path(__file__).resolve().parents[2]
ENTRY_POINTS = {
    ("console_scripts", "difftransformer-convert"): "difftransformer.convert.cli:main",
    ("console_scripts", "difftransformer-update-code"): "difftransformer.hub:main_update_code",
    ("vllm.general_plugins", "difftransformer"): "difftransformer.vllm_plugin:register",
}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    """The wheel setuptools builds from a copy of the files a source distribution holds (the checkout stays clean)."""
    pytest.importorskip("setuptools", minversion="77", reason="pyproject.toml's build backend needs setuptools >= 77")
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        (src / name).write_bytes((REPO / name).read_bytes())
    for name in ("difftransformer", "convert_scripts", "benchmarks", "tests"):  # only the first may end up in the wheel
        subprocess.run(["cp", "-r", str(REPO / name), str(src / name)], check=True)
    out = src / "dist"
    build = "import sys; from setuptools import build_meta; print(build_meta.build_wheel(sys.argv[1]))"
    proc = subprocess.run([sys.executable, "-c", build, str(out)], cwd=src, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with zipfile.ZipFile(out / proc.stdout.strip().splitlines()[-1]) as archive:
        yield archive


def test_wheel_holds_only_the_package(wheel):
    dist_info = f"difftransformer-{difftransformer.__version__}.dist-info/"
    outside = sorted({name.split("/")[0] for name in wheel.namelist()} - {"difftransformer", dist_info.rstrip("/")})
    assert not outside, outside
    modules = {name for name in wheel.namelist() if name.endswith(".py")}
    assert {
        "difftransformer/__init__.py",
        "difftransformer/convert/cli.py",
        "difftransformer/research/upcycle/job.py",
    } <= modules
    packages = {
        p.relative_to(REPO).as_posix() + "/__init__.py"
        for p in (REPO / "difftransformer").rglob("*")
        if p.is_dir() and (p / "__init__.py").is_file()
    }
    assert packages <= modules, packages - modules  # every subpackage of the checkout is installed


def test_wheel_metadata_version_license_and_dependencies(wheel):
    dist_info = f"difftransformer-{difftransformer.__version__}.dist-info/"
    metadata = email.message_from_string(wheel.read(dist_info + "METADATA").decode("utf-8"))
    assert metadata["Name"] == "difftransformer" and metadata["Version"] == difftransformer.__version__
    assert metadata["License-Expression"] == "MIT"
    assert wheel.read(dist_info + "licenses/LICENSE") == (REPO / "LICENSE").read_bytes()
    assert "MIT License" in (REPO / "LICENSE").read_text()
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    installed = [r for r in metadata.get_all("Requires-Dist") if "extra ==" not in r]
    assert {str(Requirement(r)) for r in installed} == {str(Requirement(r)) for r in declared}
    assert metadata["Requires-Python"] == ">=3.10"
    assert metadata["Description-Content-Type"] == "text/markdown"
    assert (
        metadata.get_payload().strip() == (REPO / "README.md").read_text().strip()
    )  # the readme is the long description


def test_extras_reach_the_wheel_with_their_platform_markers(wheel):
    """Each extra installs, on each platform, what pyproject.toml declares for it there: Triton (Linux wheels only) is
    part of the test extra on Linux and nowhere else, so that `pip install -e ".[test]"` works on macOS and Windows."""
    dist_info = f"difftransformer-{difftransformer.__version__}.dist-info/"
    metadata = email.message_from_string(wheel.read(dist_info + "METADATA").decode("utf-8"))
    requires = [Requirement(r) for r in metadata.get_all("Requires-Dist")]
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert set(metadata.get_all("Provides-Extra")) == set(extras)

    def names(requirements, environment):
        return {r.name for r in requirements if r.marker is None or r.marker.evaluate(environment)}

    for platform in ("linux", "darwin", "win32"):
        for extra, declared in extras.items():
            environment = {"extra": extra, "sys_platform": platform}
            installed = names([r for r in requires if r.marker is not None and "extra" in str(r.marker)], environment)
            assert installed == names([Requirement(r) for r in declared], environment), (platform, extra)
        assert ("triton" in names(requires, {"extra": "test", "sys_platform": platform})) == (platform == "linux")


def test_every_entry_point_names_a_function_that_exists(wheel):
    dist_info = f"difftransformer-{difftransformer.__version__}.dist-info/"
    parser = configparser.ConfigParser()
    parser.optionxform = str  # entry point names are case-sensitive
    parser.read_string(wheel.read(dist_info + "entry_points.txt").decode())
    found = {(group, name): value.strip() for group in parser.sections() for name, value in parser[group].items()}
    assert found == ENTRY_POINTS
    for target in found.values():
        module, function = target.split(":")
        assert callable(getattr(importlib.import_module(module), function)), target


def test_changelog_has_a_section_for_this_version():
    """A released version has its dated section; a development version (X.Y.Z.devN) has the "Unreleased" one."""
    text = (REPO / "CHANGELOG.md").read_text()
    assert "## [Unreleased]" in text  # where the next change goes
    version = Version(difftransformer.__version__)
    if not version.is_devrelease:
        assert re.search(rf"^## \[{re.escape(str(version))}\] - \d{{4}}-\d{{2}}-\d{{2}}$", text, re.M), version
    released = re.findall(r"^## \[([^\]]+)\](.*)$", text, re.M)
    for name, rest in released:
        if name != "Unreleased":  # a released section has a date, not the word "Unreleased"
            assert re.fullmatch(r" - \d{4}-\d{2}-\d{2}", rest), (name, rest)


def _package_imports() -> dict[str, set[str]]:
    """Module → the package's modules it imports, anywhere in its body (a lazy import inside a function counts:
    it is still an arrow of the structure)."""
    import ast

    root = Path(difftransformer.__file__).parent
    files = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in files.items():
        here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                base = ".".join(here[: len(here) - node.level + 1] if node.level else [])
                target = ".".join(p for p in (base, node.module or "") if p) if node.level else node.module or ""
                deps.update(t for t in (target, *(f"{target}.{a.name}" for a in node.names)) if t in files)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name in files)
        graph[name] = deps - {name}
    return graph


def test_the_package_has_no_import_circles():
    """No module of the package reaches itself through imports, lazy ones included (the structure drawing has no
    circles)."""
    graph = _package_imports()
    assert len(graph) > 10 and "difftransformer.modeling_difftransformer" in graph["difftransformer"]
    done, circles = set(), []

    def visit(name, path):
        for dep in sorted(graph[name]):
            if dep in path:
                circles.append(path[path.index(dep) :] + [dep])
            elif dep not in done:
                visit(dep, path + [dep])
        done.add(name)

    for name in sorted(graph):
        if name not in done:
            visit(name, [name])
    assert not circles, circles
