"""The GPU check's driver: one subprocess per section, each with a timeout, results to one folder.

    python3 scripts/gpu_check.py --out DIR [--wheels .gpu-wheels] [--sections a,b] [--cpu-dry-run]

The parent process imports nothing but the standard library (and wheels.py): it puts the wheel
folder's packages on the sections' PYTHONPATH beside the tree, then runs each section as
`python -m qurl.research.bench.gpu_check.runner --section NAME` in its own process group, killed at its
timeout (and at what is left of the whole budget, 8 minutes by default). A section that cannot
run says `skipped: why`; one that raises is `failed` with the last line of its error.

DIR receives two files: results.json ({"meta": ..., "sections": {name: {"status", "reason",
"seconds", "result"}}}) and gpu_check.log (this summary, then every section's own output).
Exit status 0 when no section failed or timed out (skipped ones don't count), else 1; 1 also for
a real run (not --cpu-dry-run) on a machine without CUDA, where nothing was measured.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from qurl.research.bench.gpu_check import Skip
from qurl.research.bench.gpu_check.wheels import install_site

REPO = Path(__file__).resolve().parents[4]  # above qurl/research/bench/gpu_check/
SECTIONS: dict[str, tuple[str, int, int]] = {
    # name: (module holding `section_<name>`, timeout on the GPU (s), timeout in the dry run (s));
    # the dry run takes ~55 s on 2 idle cores, its timeouts leave room for busy ones
    "env": ("kernel_checks", 60, 60),
    "gemm": ("kernel_checks", 90, 60),
    "cuda_graph": ("kernel_checks", 60, 30),
    "engine": ("kernel_checks", 90, 120),
    "learner": ("training", 150, 120),
    "train": ("training", 150, 300),
    "workers": ("training", 120, 240),
}
BUDGET_S = 480  # the whole check on one H100/H200
DRY_BUDGET_S = 900


def _run_section(name: str, out: Path, dry: bool) -> int:
    """In the section's own process: run it and write `out/<name>.json`."""
    import importlib

    t0 = time.perf_counter()
    rec: dict = {"status": "ok", "reason": "", "result": {}}
    try:
        mod = importlib.import_module(f"qurl.research.bench.gpu_check.{SECTIONS[name][0]}")
        rec["result"] = getattr(mod, f"section_{name}")(dry)
    except Skip as e:
        rec.update(status="skipped", reason=str(e))
    except Exception as e:  # reported, not raised: the next sections still run
        traceback.print_exc()
        rec.update(status="failed", reason=f"{type(e).__name__}: {e}".splitlines()[0][:300])
    rec["seconds"] = round(time.perf_counter() - t0, 2)
    (out / f"{name}.json").write_text(json.dumps(rec, indent=1, default=str))
    return 0


def _line(name: str, rec: dict) -> str:
    if rec["status"] == "ok":
        return f"{name:10s} ok ({rec['seconds']:.0f} s)  {rec['result'].get('summary', '')}"
    if rec["status"] == "skipped":
        return f"{name:10s} skipped: {rec['reason']}"
    return f"{name:10s} {rec['status'].upper()} ({rec['seconds']:.0f} s): {rec['reason']}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(name: str, work: Path, dry: bool, timeout: float, env: dict) -> dict:
    cmd = [sys.executable, "-m", "qurl.research.bench.gpu_check.runner", "--section", name,
           "--out", str(work)] + (["--cpu-dry-run"] if dry else [])
    t0 = time.perf_counter()
    # a rendezvous port of the section's own: one inherited from the caller (a test process that
    # already hosts a torch.distributed store on it) would be taken
    env = dict(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    with open(work / f"{name}.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                start_new_session=True)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # its own group: workers and ranks go too
            proc.wait()
            return {"status": "timeout", "reason": f"killed after its {timeout:.0f} s",
                    "seconds": round(time.perf_counter() - t0, 2), "result": {}}
    res = work / f"{name}.json"
    if res.is_file():
        return json.loads(res.read_text())
    tail = (work / f"{name}.log").read_text().strip().splitlines()[-1:] or ["(no output)"]
    return {"status": "failed", "reason": f"exit {proc.returncode}: {tail[0][:300]}",
            "seconds": round(time.perf_counter() - t0, 2), "result": {}}


def run(out: Path, wheels: Path, dry: bool = False, sections: list[str] | None = None,
        budget_s: float = BUDGET_S) -> dict:
    """Run the sections into `out` (results.json, gpu_check.log); returns the results."""
    t_start = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    names = sections or list(SECTIONS)
    bad = [n for n in names if n not in SECTIONS]
    if bad:
        raise SystemExit(f"unknown section(s) {bad}; choose from {', '.join(SECTIONS)}")
    lines: list[str] = []

    def say(msg: str) -> None:
        print(msg, flush=True)
        lines.append(msg)

    tmp = tempfile.TemporaryDirectory(prefix="qurl-gpu-check-")  # the wheels' site, the logs
    work = Path(tmp.name)
    site = install_site(wheels, work / "site")
    if site["refused"]:
        say(f"wheels refused: {site['refused']} (prepare the folder for this Python: "
            f"scripts/gpu_wheels.py --python {sys.version_info[0]}.{sys.version_info[1]})")
    say(f"qurl GPU check{' (CPU dry run: tiny sizes)' if dry else ''}: Python "
        f"{platform.python_version()} at {sys.executable}; wheels from {wheels}: "
        f"{', '.join(site['used']) or 'none'}")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONUNBUFFERED="1")
    paths = [p for p in (site["site"], str(REPO), env.get("PYTHONPATH")) if p]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    results: dict = {"meta": {"dry_run": dry, "python": platform.python_version(),
                              "executable": sys.executable, "wheels": site, "budget_s": budget_s,
                              "argv": sys.argv},
                     "sections": {}}
    logs: list[str] = []
    with tmp:
        for name in names:
            left = budget_s - (time.perf_counter() - t_start)
            timeout = min(SECTIONS[name][2 if dry else 1], left)
            cuda = results["sections"].get("env", {}).get("result", {}).get("cuda")
            if not dry and cuda is False and name != "env":
                rec = {"status": "skipped", "reason": "no CUDA device (see env); --cpu-dry-run "
                       "rehearses on CPU", "seconds": 0.0, "result": {}}
            elif timeout < 10:
                rec = {"status": "skipped", "reason": f"the {budget_s:.0f} s budget is spent",
                       "seconds": 0.0, "result": {}}
            else:
                rec = _launch(name, work, dry, timeout, env)
            results["sections"][name] = rec
            say(_line(name, rec))
            log = work / f"{name}.log"
            if log.is_file():
                logs.append(f"\n===== {name} ({rec['status']}) =====\n{log.read_text()}")
    wall = time.perf_counter() - t_start
    results["meta"]["wall_s"] = round(wall, 1)
    failed = [n for n, r in results["sections"].items() if r["status"] in ("failed", "timeout")]
    results["meta"]["failed"] = failed
    say(f"wall time {wall:.0f} s; {len(failed)} failed{': ' + ', '.join(failed) if failed else ''}"
        f"; results in {out}/results.json, logs in {out}/gpu_check.log")
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    (out / "gpu_check.log").write_text("\n".join(lines) + "\n" + "".join(logs))
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scripts/gpu_check.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="folder for results.json and the log")
    p.add_argument("--wheels", type=Path, default=REPO / ".gpu-wheels",
                   help="the folder scripts/gpu_wheels.py prepared (default .gpu-wheels)")
    p.add_argument("--sections", default="", help=f"comma list from {', '.join(SECTIONS)}")
    p.add_argument("--budget-s", type=float, default=None,
                   help=f"seconds for all sections (default {BUDGET_S}; dry run {DRY_BUDGET_S})")
    p.add_argument("--cpu-dry-run", action="store_true",
                   help="tiny sizes, CPU allowed: every section that can run on CPU does")
    p.add_argument("--section", help=argparse.SUPPRESS)  # internal: run one, in this process
    args = p.parse_args(argv)
    if args.section:
        return _run_section(args.section, args.out, args.cpu_dry_run)
    res = run(args.out, args.wheels, args.cpu_dry_run,
              [s for s in args.sections.split(",") if s] or None,
              args.budget_s or (DRY_BUDGET_S if args.cpu_dry_run else BUDGET_S))
    no_cuda = not args.cpu_dry_run and \
        res["sections"].get("env", {}).get("result", {}).get("cuda") is False
    return 1 if res["meta"]["failed"] or no_cuda else 0


if __name__ == "__main__":
    raise SystemExit(main())
