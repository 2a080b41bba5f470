"""The GPU image installs qurl with --no-deps on top of the SGLang image, so every dependency in
pyproject.toml must either come with that image (the Dockerfile says which) or be pinned in the
Dockerfile's own pip install; a dependency added to one file and not the other breaks the image
at import time, which no CPU test would otherwise notice."""
from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _name(req: str) -> str:
    return re.split(r"[<>=!~\[; ]", req.strip(), maxsplit=1)[0].lower().replace("_", "-")


def test_every_dependency_reaches_the_docker_image():
    deps = {_name(r) for r in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]}
    docker = (ROOT / "Dockerfile").read_text()
    pinned = {_name(m) for m in re.findall(r'"([A-Za-z0-9_.\-]+==[^"]+)"', docker)}
    stated = re.search(r"(torch,.*?) come from the SGLang image", docker, re.S)
    assert stated, "the Dockerfile must say which dependencies the SGLang image provides"
    from_image = {_name(w) for w in re.findall(r"[A-Za-z][A-Za-z0-9_\-]*", stated.group(1))
                  if w != "and"}
    missing = sorted(deps - pinned - from_image)
    assert not missing, f"pyproject dependencies missing from the Docker image: {missing}"
    assert all(re.fullmatch(r"[a-z0-9\-]+", d) for d in pinned)
