"""The package floor plan (docs/layout.md), checked from the code's own imports.

- qurl's top level holds only entry points; no module is over the 500-line soft limit;
- no two files import each other, directly or around a loop (deferred imports counted);
- rooms (the folders under qurl/) form a one-way stack: no two rooms reach each other through
  imports, counting imports inside functions and under TYPE_CHECKING too;
- only qurl/engines/sglang/inside/tp_group.py imports sglang, and the module a running SGLang
  server imports by its dotted path (`--custom-weight-loader
  qurl.engines.sglang.inside.loader.restore_w8a8`) resolves and pulls in nothing of qurl's trainer
  (the server's venv has no megatron, and must not need transformers);
- optional engine capabilities are declared protocols (qurl/types.py), never probed with
  getattr;
- research (qurl/research/studies, qurl/research/bench) stays outside the product's import graph:
  no product module imports it but qurl/cli.py, and that only inside its dispatch function;
  research imports the product's modules directly, as a user's script would;
- the public Python face, qurl/api.py, stays small: at most 20 names, each of which imports;
- every `qurl/...py` path the code and docs cite exists.
"""
from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
QURL = ROOT / "qurl"
RESEARCH = {"research"}
API_MAX = 20  # qurl/api.py: the verbs a user scripts with, not the product's rooms


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[str]:
    """Every module `path` imports, anywhere in the file (`from a import b` gives a and a.b)."""
    package = _module(path) if path.name == "__init__.py" else _module(path).rpartition(".")[0]
    out: list[str] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out += [mod] + [f"{mod}.{a.name}" for a in node.names]
    return out


def _room(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "qurl" or len(parts) < 2 or not (QURL / parts[1]).is_dir():
        return None
    return parts[1]


def room_arrows() -> dict[tuple[str, str], set[str]]:
    """{(room, room it imports): {"file -> module", ...}} over every module of qurl/."""
    arrows: dict[tuple[str, str], set[str]] = defaultdict(set)
    for path in QURL.rglob("*.py"):
        src = _room(_module(path))
        for mod in _imports(path):
            dst = _room(mod)
            if src and dst and dst != src:
                arrows[(src, dst)].add(f"{path.relative_to(ROOT)} -> {mod}")
    return arrows


def test_top_level_holds_only_entry_points():
    modules = sorted(p.name for p in QURL.glob("*.py"))
    assert modules == ["__init__.py", "__main__.py", "api.py", "cli.py", "errors.py", "types.py"]


def test_no_module_over_500_lines():
    """One concept per file; past ~500 lines a file should be asked whether it holds two (the
    bound is soft: a file is never split only to meet it)."""
    long = {str(p.relative_to(ROOT)): n for p in QURL.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 500}
    assert long == {}


def file_cycles() -> list[list[str]]:
    """Every group of qurl modules that import each other, directly or around a loop (strongly
    connected components of the module import graph, more than one module each), counting
    imports inside functions and under TYPE_CHECKING, and `from package import name` as an
    import of the package's __init__."""
    modules = {_module(p): p for p in QURL.rglob("*.py")}
    graph = {m: {i for i in _imports(p) if i in modules and i != m} for m, p in modules.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while (w := stack.pop()) != v:
                group.append(w)
            if group:
                groups.append(sorted(group + [v]))

    for m in sorted(graph):
        if m not in index:
            visit(m)
    return groups


def test_no_two_files_import_each_other():
    assert file_cycles() == []


def test_the_cycle_check_sees_a_deferred_import(tmp_path, monkeypatch):
    """A loop closed only by an import inside a function is still a loop."""
    pkg = tmp_path / "qurl" / "room"
    pkg.mkdir(parents=True)
    (tmp_path / "qurl" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from qurl.room.b import g\n")
    (pkg / "b.py").write_text("def g():\n    from qurl.room import a\n    return a\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "QURL", tmp_path / "qurl")
    assert file_cycles() == [["qurl.room.a", "qurl.room.b"]]


def test_no_two_rooms_reach_each_other():
    arrows = room_arrows()
    graph: dict[str, set[str]] = defaultdict(set)
    for a, b in arrows:
        graph[a].add(b)

    def reach(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for nxt in graph[todo.pop()] - seen:
                seen.add(nxt)
                todo.append(nxt)
        return seen

    rooms = set(graph) | {b for bs in graph.values() for b in bs}
    loops = {tuple(sorted((a, b))) for a in rooms for b in reach(a) if a != b and a in reach(b)}
    detail = {f"{a} <-> {b}": sorted(arrows.get((a, b), set()) | arrows.get((b, a), set()))
              for a, b in sorted(loops)}
    assert detail == {}, detail
    # the floor plan's fixed points: the pure core imports no other room but config/types
    assert not {b for (a, b) in arrows if a in ("algo", "quant")} - {"config", "quant"}


def test_the_weight_transport_knows_no_engine_or_learner():
    """weights/'s transport files (qurl/weights/__init__.py lists them) import bytes, tensors and
    process groups only: no other qurl room but config and node, and none of weights' own policy
    files (publish, plan, resync, arena, receiver)."""
    transport = ("delta", "digest", "buckets", "group", "sender", "broadcaster", "host", "nccl_env")
    policy = {f"qurl.weights.{m}" for m in ("publish", "plan", "resync", "arena", "receiver")}
    reach = sorted(f"{name}.py -> {m}" for name in transport
                   for m in _imports(QURL / "weights" / f"{name}.py")
                   if (_room(m) not in (None, "weights", "config", "node")) or m in policy)
    assert reach == []


def test_only_the_in_server_module_imports_sglang():
    importers = sorted(str(p.relative_to(ROOT)) for p in QURL.rglob("*.py")
                       if any(m.split(".")[0] == "sglang" for m in _imports(p)))
    assert importers == ["qurl/engines/sglang/inside/tp_group.py"]


def _loaded_by(code: str) -> list[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    probe = (f"import sys; {code}; print(sorted(m for m in sys.modules if m.split('.')[0] in "
             "('qurl', 'megatron', 'transformers', 'zmq')))")
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True,
                         timeout=120, check=True).stdout.strip()
    return ast.literal_eval(out)


def test_the_server_side_loader_path_resolves_alone():
    code = ("import importlib; mod, fn = 'qurl.engines.sglang.inside.loader.restore_w8a8'"
            ".rsplit('.', 1); assert callable(getattr(importlib.import_module(mod), fn))")
    assert _loaded_by(code) == ["qurl", "qurl.engines", "qurl.engines.sglang",
                                "qurl.engines.sglang.inside", "qurl.engines.sglang.inside.loader"]
    # the delta / verify half (imported by the loader at the first sync) needs only the wire room
    loaded = _loaded_by("import qurl.engines.sglang.inside.apply")
    assert {m for m in loaded if not m.startswith("qurl.engines.sglang.inside")} == {
        "qurl", "qurl.engines", "qurl.engines.sglang", "qurl.weights", "qurl.weights.delta",
        "qurl.weights.digest"}


def test_engine_capabilities_are_not_probed_with_getattr():
    probe = re.compile(r"getattr\([^,]+,\s*[\"'](verify|digest|adopts_chunks|adopted|can_verify)[\"']")
    hits = [f"{p.relative_to(ROOT)}:{i}" for p in QURL.rglob("*.py")
            for i, line in enumerate(p.read_text().splitlines(), 1) if probe.search(line)]
    assert hits == []


def test_the_product_never_imports_research():
    """Research (qurl/research/) sits outside the product's import graph: no module under qurl/
    imports it but cli.py, and cli.py only inside a function (its dispatch of `qurl study`,
    `qurl compare`, `qurl bench`), so importing the command line or any product room never loads
    research. Research itself imports product modules directly (those are not a stable interface);
    the stable one, qurl/api.py, stays at most API_MAX names, each resolving."""
    product = sorted(f"{p.relative_to(ROOT)} -> {m}" for p in QURL.rglob("*.py")
                     if _room(_module(p)) not in RESEARCH and p.name != "cli.py"
                     for m in _imports(p) if _room(m) in RESEARCH)
    assert product == []
    tree = ast.parse((QURL / "cli.py").read_text())
    functions = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
    inside = {id(n) for f in ast.walk(tree) if isinstance(f, functions) for n in ast.walk(f)}

    def names(node: ast.Import | ast.ImportFrom) -> list[str]:
        if isinstance(node, ast.Import):
            return [a.name for a in node.names]
        return [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]

    at_top = [f"qurl/cli.py:{n.lineno}" for n in ast.walk(tree)
              if isinstance(n, (ast.Import, ast.ImportFrom)) and id(n) not in inside
              and any(_room(m) in RESEARCH for m in names(n))]
    assert at_top == []  # cli.py reaches research only when its dispatch runs a research command
    import qurl.api

    assert len(qurl.api.__all__) <= API_MAX
    assert [n for n in qurl.api.__all__ if getattr(qurl.api, n, None) is None] == []


def test_every_public_name_imports():
    """`from qurl.api import NAME` works for each of qurl.api.__all__ (at most API_MAX names, none
    twice), in a fresh interpreter; `import qurl.api` alone loads neither torch nor megatron (its
    docstring: what needs torch resolves on first use)."""
    import qurl.api

    names = list(qurl.api.__all__)
    assert 0 < len(names) <= API_MAX and len(set(names)) == len(names)
    code = ("import sys; import qurl.api; "
            "heavy = sorted(m for m in ('torch', 'megatron') if m in sys.modules); "
            + "; ".join(f"from qurl.api import {n}" for n in names) + "; print(heavy)")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert ast.literal_eval(out.stdout.strip().splitlines()[-1]) == []



def test_every_cited_qurl_path_exists():
    """Docstrings, comments, README and docs/ cite files as `qurl/room/file.py`; a move that leaves
    one behind fails here (a file citing a neighbour in its own folder uses the bare name)."""
    cited = re.compile(r"(?<![\w/.])qurl/[\w/]+\.py")
    texts = [*QURL.rglob("*.py"), ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]
    stale = sorted({f"{p.relative_to(ROOT)}: {m}" for p in texts
                    for m in cited.findall(p.read_text()) if not (ROOT / m).is_file()})
    assert stale == []
