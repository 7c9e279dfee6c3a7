"""The declared version ranges are true: every lower bound in pyproject.toml is a version CI installs, and the
"Tested versions" table of docs/ecosystem.md names what the CI scripts install (scripts/setup.sh: requirements-dev.txt;
scripts/setup_min.sh: pyproject.toml's lowest transformers; scripts/setup_latest.sh: the newest releases, resolved
per run)."""

import re
from pathlib import Path

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = pytest.importorskip("tomli", reason="reading pyproject.toml needs tomllib (Python 3.11) or tomli")

REPO = Path(__file__).resolve().parents[2]
BOUNDED = ("torch", "transformers", "peft", "accelerate", "safetensors", "tokenizers")


def _newest_versions():
    """scripts/newest_versions.py, which CI runs to compare pip's resolution with the pins."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("newest_versions", REPO / "scripts" / "newest_versions.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def pins() -> dict[str, str]:
    """requirements-dev.txt: what scripts/setup.sh installs (the pinned run); names normalised (huggingface-hub)."""
    return _newest_versions().pinned()


def requirements() -> list[str]:
    """Every requirement pyproject.toml declares: the dependencies and every extra's."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return project["dependencies"] + [r for extra in project["optional-dependencies"].values() for r in extra]


def lower_bounds() -> dict[str, list[str]]:
    """Every `name>=X` in pyproject.toml (dependencies and extras), by package."""
    bounds: dict[str, list[str]] = {}
    for requirement in requirements():
        match = re.match(r"([A-Za-z0-9_.-]+)\s*>=\s*([0-9][0-9.]*)", requirement)
        if match:
            bounds.setdefault(match[1].lower(), []).append(match[2])
    return bounds


def lowest_transformers() -> str:
    """What scripts/setup_min.sh installs: the X.Y of pyproject.toml's `transformers>=X.Y,` (any X.Y.* release), read
    with the script's own sed expression."""
    script = (REPO / "scripts" / "setup_min.sh").read_text()
    command = "MIN=$(sed -n 's/.*\"transformers>=\\([0-9.]*\\),.*/\\1/p' pyproject.toml)"
    assert command in script, "setup_min.sh reads pyproject.toml"
    lines = [
        line
        for line in (REPO / "pyproject.toml").read_text().splitlines()
        if re.match(r'.*"transformers>=([0-9.]*),', line)
    ]
    found = {re.match(r'.*"transformers>=([0-9.]*),', line)[1] for line in lines}
    assert found == set(lower_bounds()["transformers"]) and len(found) == 1, (found, lower_bounds()["transformers"])
    return found.pop()


def lowest_pins() -> dict[str, str]:
    """requirements-min.txt: what scripts/setup_min.sh installs besides transformers (the lowest-version run)."""
    assert "requirements-min.txt" in (REPO / "scripts" / "setup_min.sh").read_text()
    found = {}
    for line in (REPO / "requirements-min.txt").read_text().splitlines():
        match = re.match(r"^([A-Za-z0-9_.-]+)==([0-9][^\s#]*)", line.strip())
        if match:
            found[match[1].lower()] = match[2]
    return found


def same_release(bound: str, installed: str) -> bool:
    """`>=2.13` is run by 2.13.0, `>=0.23.3` by 0.23.3 (a bound names a release, trailing zeros aside)."""

    def norm(v):
        parts = [int(p) for p in v.split(".")]
        while parts and parts[-1] == 0:
            parts.pop()
        return parts

    return norm(bound) == norm(installed)


@pytest.mark.parametrize("package", BOUNDED)
def test_every_lower_bound_is_a_version_ci_runs(package):
    bounds = lower_bounds().get(package)
    assert bounds, f"pyproject.toml declares no lower bound for {package}"
    ci_runs = {pins()[package]} | ({lowest_transformers()} if package == "transformers" else set())
    ci_runs |= {version for name, version in lowest_pins().items() if name == package}
    for bound in bounds:
        assert any(same_release(bound, version) for version in ci_runs), (
            f"pyproject.toml: {package}>={bound}, but CI installs {sorted(ci_runs)} (raise the bound or test that "
            "version)"
        )


def test_docs_tested_versions_are_what_ci_installs():
    """docs/ecosystem.md's "Tested versions" table: the pinned run's versions are requirements-dev.txt's, the lowest
    run's transformers is the declared lower bound, and the newest run resolves the newest releases at each run."""
    section = (REPO / "docs" / "ecosystem.md").read_text().split("### Tested versions", 1)[1].split("\n#", 1)[0]
    rows = {
        cells[1].strip(): cells for cells in (line.split("|") for line in section.splitlines() if line.startswith("| "))
    }
    assert {"pinned", "newest", "lowest"} <= set(rows), sorted(rows)
    installed = pins()
    pinned = " ".join(rows["pinned"][3:5])
    expected = [
        installed["transformers"],
        *(
            f"{name} {installed[name.replace('_', '-')]}"
            for name in ("torch", "peft", "accelerate", "tokenizers", "safetensors", "huggingface_hub")
        ),
    ]
    missing = [fragment for fragment in expected if fragment not in pinned]
    assert not missing, (missing, pinned)
    assert f"{lowest_transformers()}.x" in rows["lowest"][3], rows["lowest"][3]
    assert "newest release" in rows["newest"][3] and "resolved at each run" in rows["newest"][3], rows["newest"][3]
    assert "scripts/setup_latest.sh" in (REPO / "scripts" / "test.sh").read_text()  # the newest run exists
    assert "--upgrade-strategy eager" in (REPO / "scripts" / "setup_latest.sh").read_text()  # resolved, not pinned


def test_newest_versions_tells_whether_the_newest_releases_are_the_pinned_ones():
    """scripts/newest_versions.py reads pip's dry-run report: exit 0 (the pinned run covered them) only where every
    package CI names is at its pinned version; 3 where one is newer (CI then builds .venv-latest and tests there);
    2 where the report lacks one."""
    nv = _newest_versions()

    def report(**versions):
        return {
            "install": [
                {"metadata": {"name": n, "version": versions.get(n, pins()[nv.normalize(n)])}} for n in nv.PACKAGES
            ]
            + [{"metadata": {"name": "numpy", "version": "9.9"}}]
        }

    line, code = nv.compare(report(torch=pins()["torch"] + "+cpu"))
    assert code == 0 and f"transformers {pins()['transformers']}" in line and "numpy" not in line
    major, minor = pins()["transformers"].split(".")[:2]
    line, code = nv.compare(report(transformers=f"{major}.{int(minor) + 1}.0"))
    assert code == 3 and f"transformers {major}.{int(minor) + 1}.0" in line
    missing = report()
    missing["install"] = [i for i in missing["install"] if i["metadata"]["name"] != "peft"]
    assert nv.compare(missing)[1] == 2
    assert "--dry-run --ignore-installed" in (REPO / "scripts" / "test.sh").read_text()
