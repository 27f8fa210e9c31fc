"""The package layout holds: docs/architecture.md's layer table names every package and top-level
module of src/dropless, imports point only down that table (or sideways within a layer), no two
modules or packages import each other in a circle, no module imports another package's
private (`_name`) module or function, and the modules of `dropless eval`, `generate` and
`convert` reach nothing of train/, and the MoE layer (moe/) names no kernel: it imports no backend
module of ops and picks no platform (the capability registry, ops.kernels, does).

Every import counts, also one inside a function (a lazy import is still a dependency)."""
from __future__ import annotations

import ast
import re

import pytest
from tests._support.paths import ROOT


PKG = ROOT / "src" / "dropless"
DOC = ROOT / "docs" / "architecture.md"


def layers() -> dict[str, int]:
    """unit (a package or top-level module of dropless) -> its layer, from the table in
    docs/architecture.md: the rows between the `<!-- layers -->` markers, `| N | unit, unit | ...`."""
    text = DOC.read_text()
    block = text.split("<!-- layers -->")[1]
    out = {}
    for row in re.finditer(r"^\|\s*(\d+)\s*\|([^|]+)\|", block, flags=re.M):
        for unit in re.findall(r"`([a-z_.]+)/?`", row.group(2)):
            out[unit] = int(row.group(1))
    return out


def modules() -> dict[str, ast.Module]:
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = ast.parse(path.read_text(), str(path))
    return out


MODULES = modules()
TABLE = layers()


def unit_of(module: str) -> str:
    """The table's unit a module belongs to: the longest entry that is the module or a package
    above it (dropless.moe.dispatch.a2a -> moe; dropless.model_dir.weights -> model_dir.weights
    when the table names it, else model_dir); dropless itself -> dropless."""
    parts = module.split(".")[1:]
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in TABLE:
            return ".".join(parts[:n])
    return parts[0] if parts else "dropless"


def imports(name: str, tree: ast.Module) -> list[tuple[str, str | None, int]]:
    """(imported dropless module, imported name or None, line) for every import in `tree`."""
    pkg = name if _is_package(name) else name.rsplit(".", 1)[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, None, node.lineno) for a in node.names if a.name.startswith("dropless")]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            if not base.startswith("dropless"):
                continue
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.append((sub, None, node.lineno) if sub in MODULES else (base, a.name, node.lineno))
    return out


def _is_package(name: str) -> bool:
    return (PKG.parent / name.replace(".", "/") / "__init__.py").exists()


def edges() -> list[tuple[str, str, str | None, int]]:
    return [(src, dst, what, line) for src, tree in MODULES.items()
            for dst, what, line in imports(src, tree) if dst != src]


def test_every_unit_has_a_layer_and_the_table_names_no_ghosts():
    table = TABLE
    units = {unit_of(m) for m in MODULES}
    assert not units - set(table), f"add these to docs/architecture.md's layer table: " \
                                   f"{sorted(units - set(table))}"
    assert not set(table) - units, f"docs/architecture.md names units that do not exist: " \
                                   f"{sorted(set(table) - units)}"


def test_imports_point_down_the_layers():
    table = TABLE
    up = [f"{src}:{line} imports {dst} (layer {table[unit_of(dst)]} above {table[unit_of(src)]})"
          for src, dst, _, line in edges()
          if table[unit_of(dst)] > table[unit_of(src)]]
    assert not up, "\n".join(up)


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state, stack = {}, []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        state[n] = 2
        stack.pop()
        return None

    for n in sorted(graph):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


@pytest.mark.parametrize("level", ["module", "unit"])
def test_no_import_circle(level):
    graph: dict[str, set[str]] = {}
    for src, dst, _, _ in edges():
        if level == "unit":
            src, dst = unit_of(src), unit_of(dst)
            if src == dst:
                continue
        elif dst.startswith(src + ".") or src.startswith(dst + "."):
            continue   # a package and its own modules (its __init__ re-exports them)
        graph.setdefault(src, set()).add(dst)
    found = _cycle(graph)
    assert found is None, " -> ".join(found)


def test_no_private_name_across_packages():
    def package(module):
        return module if _is_package(module) else module.rsplit(".", 1)[0]

    bad = []
    for src, dst, what, line in edges():
        if package(src) == package(dst) or package(dst).startswith(package(src) + "."):
            continue
        private_module = any(p.startswith("_") and p != "__init__" for p in dst.split("."))
        if private_module or (what or "").startswith("_"):
            bad.append(f"{src}:{line} imports {dst}{'.' + what if what else ''}")
    assert not bad, "\n".join(bad)


def test_the_checks_see_a_violation():
    """The walker finds lazy imports and resolves relative ones (else the rules above prove
    nothing)."""
    tree = ast.parse("def f():\n    from dropless.train import loop\n    from . import rows\n")
    found = {d for d, _, _ in imports("dropless.moe.dispatch.a2a", tree)}
    assert {"dropless.train.loop", "dropless.moe.dispatch.rows"} <= found
    assert _cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]


# `dropless eval`, `generate` and `convert` load and write models without training: these
# modules reach nothing of train/ through any import, lazy ones included.
NO_TRAIN = ("dropless.cli.eval", "dropless.cli.generate", "dropless.cli.convert",
            "dropless.cli.model_args", "dropless.models.evaluate", "dropless.models.generate")
# the packages whose __init__ an import runs first; `dropless.cli` is left out: its __init__ is
# the command table, which names every command (train too) and is shared by all of them
SKIPPED_PACKAGES = ("dropless.cli",)


def import_chain(start: tuple[str, ...], graph: dict[str, set[str]], banned: str
                 ) -> list[str] | None:
    """The shortest chain of imports from a module of `start` to a module in package `banned`
    (None when there is none): what each module imports, transitively, and the packages above
    each (their __init__ runs on import; `SKIPPED_PACKAGES` aside)."""
    parent: dict[str, str | None] = {m: None for m in start}
    todo = list(start)
    while todo:
        m = todo.pop(0)
        if m == banned or m.startswith(banned + "."):
            chain = [m]
            while parent[chain[-1]] is not None:
                chain.append(parent[chain[-1]])
            return chain[::-1]
        parts = m.split(".")
        above = [".".join(parts[:n]) for n in range(2, len(parts))]
        for n in sorted(graph.get(m, ())) + [p for p in above if p not in SKIPPED_PACKAGES]:
            if n not in parent:
                parent[n] = m
                todo.append(n)
    return None


def test_eval_generate_and_convert_import_nothing_from_train():
    graph: dict[str, set[str]] = {}
    for src, dst, _, _ in edges():
        graph.setdefault(src, set()).add(dst)
    assert set(NO_TRAIN) <= set(MODULES)
    chain = import_chain(NO_TRAIN, graph, "dropless.train")
    assert chain is None, " -> ".join(chain)


def test_the_train_check_sees_a_lazy_import():
    """A lazy import two steps away (in a package __init__ above an imported module) is found."""
    tree = ast.parse("def load():\n    from dropless.train.step import init_state\n")
    graph = {"dropless.cli.eval": {"dropless.model_dir.weights"},
             "dropless.model_dir": {dst for dst, _, _ in imports("dropless.model_dir", tree)}}
    assert import_chain(("dropless.cli.eval",), graph, "dropless.train") == [
        "dropless.cli.eval", "dropless.model_dir.weights", "dropless.model_dir",
        "dropless.train.step"]


TESTS = ROOT / "tests"
# test folders that test no package of src/dropless: the CI scripts and Makefile (tests/ci)
NOT_PACKAGES = ("ci", "_support", "fixtures")


def _tested_module(path) -> bool:
    """Whether tests/<dir>/test_<name>.py sits where docs/architecture.md says: <dir> is a
    package of src/dropless (tests/ itself: the top-level modules), and <name>, or a prefix of
    it cut at an underscore (test_loop_inflight.py -> loop), is a module or package in it."""
    rel = path.relative_to(TESTS)
    home = PKG.joinpath(*rel.parts[:-1])
    words = rel.stem[len("test_"):].split("_")
    names = ["_".join(words[:n]) for n in range(1, len(words) + 1)]
    return home.is_dir() and any((home / f"{n}.py").is_file() or (home / n).is_dir()
                                 for n in names)


def test_every_test_file_names_the_module_it_tests():
    files = [p for p in sorted(TESTS.rglob("test_*.py"))
             if p.relative_to(TESTS).parts[0] not in NOT_PACKAGES
             and p != TESTS / "test_architecture.py"]
    misplaced = [str(p.relative_to(ROOT)) for p in files if not _tested_module(p)]
    assert not misplaced, ("name these tests/<package>/test_<module>[_more].py after what they "
                           f"test: {misplaced}")
    assert _tested_module(TESTS / "train" / "test_loop_inflight.py")
    assert not _tested_module(TESTS / "plan" / "test_calibrate.py")   # calibrate is bench's


def test_only_cli_parses_arguments_and_exits():
    """argparse, SystemExit and sys.exit belong to `cli/` alone: below it, errors are raised."""
    bad = []
    for name, tree in MODULES.items():
        if name == "dropless.cli" or name.startswith("dropless.cli."):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Import) and any(a.name == "argparse" for a in node.names) \
                    or isinstance(node, ast.ImportFrom) and node.module == "argparse" \
                    or isinstance(node, ast.Name) and node.id == "SystemExit" \
                    or isinstance(node, ast.Attribute) and node.attr == "exit" \
                    and isinstance(node.value, ast.Name) and node.value.id == "sys":
                bad.append(f"{name}:{node.lineno}")
    assert not bad, f"parse arguments and exit in cli/ only: {bad}"


# The MoE layer asks for kernels by capability and names none: each platform's kernels are
# chosen in ops (`ops.kernels`: the sort, top-k, the row gathers, the fused FFN; `ops.gmm`: the
# grouped matmul). moe/ reaches ops only through these; the dispatcher's own registry
# (`moe/dispatch/`) picks a dispatch strategy per platform, which is not a kernel choice.
MOE_OPS = ("dropless.ops", "dropless.ops.gmm", "dropless.ops.kernels")
DISPATCH_CHOOSERS = ("dropless.moe.dispatch.registry", "dropless.moe.dispatch.expert_parallel")
PLATFORM_CHOICE = ("default_backend", "platform_dependent")


def kernel_choices(name: str, tree: ast.Module, source: str) -> list[str]:
    """Where module `name` (of moe/) names a kernel or picks one: an import of ops beyond
    `MOE_OPS` (a backend module: ops.native, ops.gpu, ops.gmm.tiled, ...), a use of
    `jax.default_backend` or `platform_dependent` outside `DISPATCH_CHOOSERS`, or the name of
    the native backend's old name anywhere in its text."""
    bad = [f"{name}:{line} imports {dst}" for dst, _, line in imports(name, tree)
           if (dst == "dropless.ops" or dst.startswith("dropless.ops.")) and dst not in MOE_OPS]
    if name not in DISPATCH_CHOOSERS:
        bad += [f"{name}:{node.lineno} uses {_referent(node)}" for node in ast.walk(tree)
                if _referent(node) in PLATFORM_CHOICE]
    bad += [f"{name}:{n + 1} names openblas" for n, text in enumerate(source.splitlines())
            if "openblas" in text.lower()]
    return bad


def _referent(node: ast.AST) -> str | None:
    """The name an attribute, a name or an imported name refers to (None for other nodes)."""
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.alias):
        return node.name.rsplit(".", 1)[-1]
    return None


def test_the_moe_layer_names_no_kernel():
    moe = [m for m in MODULES if m == "dropless.moe" or m.startswith("dropless.moe.")]
    assert "dropless.moe.experts" in moe and "dropless.moe.dispatch.registry" in moe
    bad = []
    for name in moe:
        path = PKG.parent / (name.replace(".", "/") + ("/__init__.py" if _is_package(name)
                                                       else ".py"))
        bad += kernel_choices(name, MODULES[name], path.read_text())
    assert not bad, ("the MoE layer asks dropless.ops.kernels for a capability; the platform "
                     "choice is made there:\n" + "\n".join(bad))


def test_the_kernel_check_sees_a_violation():
    src = ("import jax\nfrom dropless.ops import native\nfrom dropless.ops.gpu import pallas_gpu\n"
           "from jax.lax import platform_dependent\n"
           "def f(x):\n    return jax.default_backend()  # openblas\n")
    found = kernel_choices("dropless.moe.router", ast.parse(src), src)
    assert len(found) == 5, found
    assert kernel_choices("dropless.moe.dispatch.registry", ast.parse(src), "") == [
        "dropless.moe.dispatch.registry:2 imports dropless.ops.native",
        "dropless.moe.dispatch.registry:3 imports dropless.ops.gpu.pallas_gpu"]


def drawing() -> str:
    """The units' imports as they are, one line a unit, top layer first:
    `12 cli -> bench, config_file, ...` (the units it imports directly, by layer, highest
    first). docs/architecture.md shows this between its `<!-- drawing -->` markers."""
    deps: dict[str, set[str]] = {u: set() for u in TABLE}
    for src, dst, _, _ in edges():
        if unit_of(src) != unit_of(dst):
            deps[unit_of(src)].add(unit_of(dst))
    order = sorted(TABLE, key=lambda u: (-TABLE[u], u))
    width = max(map(len, order))
    lines = []
    for u in order:
        down = sorted(deps[u], key=lambda d: (-TABLE[d], d))
        lines.append(f"{TABLE[u]:>2} {u:<{width}} -> {', '.join(down) or '(nothing)'}".rstrip())
    return "\n".join(lines)


def test_the_docs_drawing_is_the_code():
    shown = DOC.read_text().split("<!-- drawing -->")[1].strip().strip("`").strip()
    assert shown == drawing(), ("docs/architecture.md's drawing differs from the imports; "
                                "paste the output of `python -m tests.test_architecture`:\n"
                                + drawing())


if __name__ == "__main__":
    print(drawing())
