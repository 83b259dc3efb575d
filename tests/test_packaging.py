"""What a fresh clone installs: every declared dependency is pinned in constraints.txt to a
version its own range allows, the licence pyproject.toml declares is the file beside it, and the
installed packages are the library's (benchmarks/ and tests/ stay in the repository)."""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from setuptools import find_namespace_packages, find_packages

REPO = Path(__file__).resolve().parents[1]


def _pins() -> dict[str, str]:
    pins = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, version = line.split("==")
            pins[canonicalize_name(name)] = version.strip()
    return pins


def test_constraints_pin_every_dependency_within_its_declared_range():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    pins = _pins()
    for text in [*project["dependencies"], *project["optional-dependencies"]["dev"]]:
        requirement = Requirement(text)
        name = canonicalize_name(requirement.name)
        assert name in pins, f"{name} is not pinned in constraints.txt"
        assert requirement.specifier.contains(pins[name], prereleases=True), (
            f"{name}=={pins[name]} is outside {requirement.specifier}"
        )


def test_python_and_licence_match_what_is_declared():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert SpecifierSet(project["requires-python"]).contains(f"{sys.version_info.major}.{sys.version_info.minor}")
    assert not SpecifierSet(project["requires-python"]).contains("3.10")  # typing.Self needs 3.11
    assert project["license"]["text"] == "Apache-2.0"
    assert re.search(r"Apache License\s+Version 2\.0", (REPO / "LICENSE").read_text())


def test_the_installed_packages_are_the_library_without_benchmarks_or_tests():
    find = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    finder = (
        find_namespace_packages if find.get("namespaces", True) else find_packages
    )  # setuptools' default for packages.find
    installed = finder(where=str(REPO), include=find["include"], exclude=find.get("exclude", ()))
    assert {name.split(".")[0] for name in installed} == {"pipeline", "prm", "eval", "stages"}
    assert (REPO / "benchmarks" / "__init__.py").exists() and "benchmarks" not in installed
