"""The package metadata declares ranges; the exact versions live in constraints.txt.

``pip install "flashckpt[deepspeed]"`` on a machine with its own torch build must not
replace it, so no extra pins a framework exactly. The CPU test venv stays reproducible
through constraints.txt, which every pip call of the Makefile takes; each pin there must
satisfy the range the metadata declares, or ``make`` fails to resolve. Pure file checks:
no network, no install.
"""

from __future__ import annotations

import os
import re
import tomllib

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FRAMEWORKS = {"torch", "deepspeed", "megatron-core", "transformers", "accelerate", "tensorflow-cpu",
              "tensorflow", "tensorflow-estimator", "lightning", "pytorch-lightning", "s3fs", "numpy"}
"""Packages a user's environment may already hold in a build of its own."""


def _project() -> dict:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["project"]


def _requirements() -> list[tuple[str, Requirement]]:
    """(where, requirement) for the core dependencies and every extra, self-references left out."""
    project = _project()
    found = [("dependencies", Requirement(r)) for r in project["dependencies"]]
    for extra, reqs in project["optional-dependencies"].items():
        found += [(f"[{extra}]", Requirement(r)) for r in reqs]
    return [(where, req) for where, req in found if canonicalize_name(req.name) != "flashckpt"]


def _constraints() -> dict[str, Version]:
    pins: dict[str, Version] = {}
    with open(os.path.join(ROOT, "constraints.txt")) as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            req = Requirement(line)
            specs = list(req.specifier)
            assert len(specs) == 1 and specs[0].operator == "==" and "*" not in specs[0].version, \
                f"constraints.txt: {line!r} is not an exact pin"
            pins[canonicalize_name(req.name)] = Version(specs[0].version)
    return pins


def test_no_framework_is_pinned_exactly():
    for where, req in _requirements():
        if canonicalize_name(req.name) in FRAMEWORKS:
            ops = {spec.operator for spec in req.specifier}
            assert not ops & {"==", "===", "~="}, f"{where} pins {req}: declare the supported range"
            assert ">=" in ops, f"{where} {req}: no lower bound (the oldest release whose APIs the code uses)"


def test_constraints_satisfy_the_declared_ranges():
    pins = _constraints()
    for where, req in _requirements():
        pin = pins.get(canonicalize_name(req.name))
        assert pin is not None, f"{where} {req.name} is not pinned in constraints.txt: make's venv would drift"
        assert req.specifier.contains(pin, prereleases=True), \
            f"constraints.txt pins {req.name}=={pin}, outside {where} {req}"


def test_constraints_pin_the_cpu_torch_wheel():
    """torch==2.13.0 takes the local CPU wheel (2.13.0+cpu); another spec would pull CUDA."""
    torch = _constraints()["torch"]
    assert torch.local is None and torch == Version("2.13.0")


def test_every_pip_call_of_the_makefile_takes_the_constraints():
    with open(os.path.join(ROOT, "Makefile")) as f:
        text = f.read()
    variables = dict(re.findall(r"^(\w+)\s*:=\s*(.*)$", text, re.M))
    calls = 0
    for line in text.splitlines():
        if not line.startswith("\t"):
            continue
        expanded = re.sub(r"\$\((\w+)\)", lambda m: variables.get(m.group(1), m.group(0)), line)
        if "pip install" in expanded:
            calls += 1
            assert "-c constraints.txt" in expanded, f"Makefile: {line.strip()!r} installs without the constraints"
            assert not re.search(r"==\d", expanded), f"Makefile: {line.strip()!r} pins a version itself"
    assert calls >= 4


@pytest.mark.parametrize("name", ["torch", "deepspeed", "megatron-core", "transformers", "tensorflow-cpu",
                                  "lightning"])
def test_the_readme_names_the_tested_version(name):
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    assert f"{name} {_constraints()[name]}" in readme, f"README: no '{name} <tested version>'"
