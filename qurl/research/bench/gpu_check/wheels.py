"""The wheels the GPU check brings along: what qurl needs that the GPU image lacks.

The GPU machine has its own Python with a CUDA torch, transformers, tokenizers, safetensors,
numpy, packaging, pyarrow, matplotlib and tqdm, but no network, so the rest travels with the
tree, as wheels in ONE git-ignored folder (default `.gpu-wheels/`) that this machine prepares:

    python scripts/gpu_wheels.py [--python 3.12|3.11] [--dest .gpu-wheels]

Per dependency of qurl (pyproject.toml), whether the check needs it:
- megatron-core 0.16.1: the learner (learner, train, workers sections); megatron_patches pins it.
- blake3: checkpoint manifests and weight digests (train, workers).
- pyzmq: the trajectory stream between controller and rollout workers (workers).
- math-verify, gguf, wandb: not needed (math rewards, GGUF import, optional logging): not brought.
- the rest is in the image (safetensors 0.8, tokenizers 0.23, transformers 5.x, numpy 2.x).
All three are platform wheels (cpXY manylinux x86_64), so they are made for one Python version:
the folder's manifest.json records it and the check refuses a folder made for another.

On the GPU machine nothing is installed: `install_site` extracts each wheel (a zip file) into a
temporary folder that goes first on sys.path and on the sections' PYTHONPATH. This module uses
the standard library only: the check's parent process imports it before anything else.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PINS: dict[str, str] = {"megatron-core": "0.16.1", "blake3": "1.0.11", "pyzmq": "27.3.0"}
"""Distribution -> version brought along (the versions this tree is tested with)."""
IMPORTS: dict[str, str] = {"megatron-core": "megatron.core", "blake3": "blake3", "pyzmq": "zmq"}
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_26_x86_64",
             "manylinux_2_24_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64")
PYTHONS = ("3.11", "3.12")
MANIFEST = "manifest.json"
LIMIT_BYTES = 48 << 20
"""The folder's cap: the device machine takes 64 MiB in all, the tree included."""
_WHEEL = re.compile(r"^(?P<name>[^-]+)-(?P<ver>[^-]+)(-\d[^-]*)?-(?P<py>[^-]+)-(?P<abi>[^-]+)-"
                    r"(?P<plat>[^-]+)\.whl$")


def download_command(dest: Path, python: str = "3.12",
                     pins: dict[str, str] | None = None) -> list[str]:
    """The `pip download` command line fetching `pins` as binary wheels for CPython `python`
    (x86_64 manylinux or pure), without their dependencies (the image has those)."""
    if python not in PYTHONS:
        raise ValueError(f"python must be one of {PYTHONS}, got {python!r}")
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
           "--python-version", python, "--implementation", "cp", "-d", str(dest)]
    for plat in PLATFORMS:
        cmd += ["--platform", plat]
    return cmd + [f"{n}=={v}" for n, v in (pins or PINS).items()]


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())


def check_size(folder: Path, limit: int = LIMIT_BYTES) -> int:
    """The folder's size in bytes; ValueError when it is over `limit`."""
    size = folder_bytes(folder)
    if size > limit:
        raise ValueError(f"{folder}: {size / 2**20:.1f} MiB of wheels, over the {limit / 2**20:.0f} "
                         f"MiB cap (the device machine takes 64 MiB with the tree)")
    return size


def prepare(dest: Path, python: str = "3.12", limit: int = LIMIT_BYTES) -> dict:
    """Download the pinned wheels for `python` into a fresh `dest` (replacing its wheels), check
    its size and write its manifest; returns the manifest."""
    dest = Path(dest)
    with tempfile.TemporaryDirectory(prefix="qurl-wheels-") as tmp:
        subprocess.run(download_command(Path(tmp), python), check=True)
        wheels = sorted(Path(tmp).glob("*.whl"))
        missing = [n for n in PINS if not any(_dist(w.name) == _norm(n) for w in wheels)]
        if missing:
            raise RuntimeError(f"pip brought no wheel for {missing}")
        check_size(Path(tmp), limit)
        if dest.exists():
            shutil.rmtree(dest)
        dest.mkdir(parents=True)
        for w in wheels:
            shutil.copy2(w, dest / w.name)
    manifest = {"python": python, "pins": PINS,
                "files": {w.name: (dest / w.name).stat().st_size for w in wheels}}
    manifest["bytes"] = check_size(dest, limit)
    (dest / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def _dist(filename: str) -> str:
    m = _WHEEL.match(filename)
    return _norm(m.group("name")) if m else ""


def wheel_fits(filename: str, version: tuple[int, int] | None = None,
               machine: str = "x86_64") -> str | None:
    """None when the wheel `filename` installs on CPython `version` (default: this one) on Linux
    `machine`, else why not."""
    m = _WHEEL.match(filename)
    if not m:
        return "not a wheel file name"
    major, minor = version or sys.version_info[:2]
    pys, abis = m.group("py").split("."), m.group("abi").split(".")
    plats = m.group("plat").split(".")
    if "any" not in plats and not any(p.startswith(("manylinux", "linux")) and p.endswith(machine)
                                      for p in plats):
        return f"built for {m.group('plat')}, not Linux {machine}"
    if any(p in ("py3", f"py{major}") for p in pys) and "none" in abis:
        return None  # pure Python
    tag = f"cp{major}{minor}"
    if tag in pys:
        return None
    if "abi3" in abis:
        lowest = min((int(p[3:]) for p in pys if p.startswith("cp3") and p[3:].isdigit()),
                     default=99)
        if lowest <= minor:
            return None
    return f"built for {m.group('py')}, this Python is {tag}"


def install_site(wheels: Path, site: Path | None = None,
                 version: tuple[int, int] | None = None) -> dict:
    """Extract the folder's wheels that fit this Python into `site` (a new temporary folder by
    default) and put it first on sys.path. Returns {"site", "used": [file], "refused": {file:
    why}, "manifest"}; "site" is None when nothing was extracted (no folder, no fitting wheel)."""
    wheels = Path(wheels)
    out: dict = {"site": None, "used": [], "refused": {}, "manifest": None}
    if not wheels.is_dir():
        return out
    if (wheels / MANIFEST).is_file():
        out["manifest"] = json.loads((wheels / MANIFEST).read_text())
    files = sorted(wheels.glob("*.whl"))
    for f in files:
        why = wheel_fits(f.name, version)
        if why:
            out["refused"][f.name] = why
        else:
            out["used"].append(f.name)
    if not out["used"]:
        return out
    site = Path(site) if site is not None else Path(tempfile.mkdtemp(prefix="qurl-gpu-site-"))
    site.mkdir(parents=True, exist_ok=True)
    for name in out["used"]:
        with zipfile.ZipFile(wheels / name) as z:
            z.extractall(site)
    out["site"] = str(site)
    if str(site) not in sys.path:
        sys.path.insert(0, str(site))
    return out


def main(argv: list[str] | None = None) -> int:
    """`scripts/gpu_wheels.py`: prepare the wheel folder here (needs pip and PyPI)."""
    import argparse

    p = argparse.ArgumentParser(prog="scripts/gpu_wheels.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--python", default="3.12", choices=PYTHONS,
                   help="the GPU image's Python version (default 3.12)")
    p.add_argument("--dest", type=Path, default=Path(__file__).resolve().parents[4] / ".gpu-wheels")
    p.add_argument("--limit-mib", type=float, default=LIMIT_BYTES / 2**20)
    args = p.parse_args(argv)
    man = prepare(args.dest, args.python, int(args.limit_mib * 2**20))
    for name, size in man["files"].items():
        print(f"  {name}  {size / 2**20:.2f} MiB")
    print(f"{args.dest}: {len(man['files'])} wheels for Python {args.python}, "
          f"{man['bytes'] / 2**20:.1f} MiB (cap {args.limit_mib:.0f} MiB)")
    return 0
