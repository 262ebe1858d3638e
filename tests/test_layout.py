"""The code's rooms and the direction of its imports (docs/design.md §11): every product file's imports,
function-level ones included, go downward only —

    core ← heads ← engine ← artifacts ← targets and vLLM pieces ← data ← train, evaluation ← experiments ← scripts, bench

(experiments/stages.py holds the stage entries the studies and scripts/ call) — no module imports one above it, nor
one of another package on its own level, and no two modules import each other through any chain. heads/ holds
networks only and opens no file; core/ imports nothing of spechead."""

from __future__ import annotations

import ast
import re
import sys
import tokenize
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("core", "heads", "inference_eval", "artifacts", "data", "train", "evaluation", "experiments", "scripts",
            "bench")
ENGINE = ("inference_eval.engine", "inference_eval.paged", "inference_eval.model", "inference_eval.families",
          "inference_eval.scoring", "inference_eval.speculative", "inference_eval")
TARGETS_AND_VLLM = ("inference_eval.targets", "inference_eval.vllm_backend", "inference_eval.vllm_worker", "inference_eval.vllm_spec",
                    "inference_eval.vllm_serve_worker", "inference_eval.vllm_generate_worker", "inference_eval.vllm_plugin",
                    "inference_eval.vllm_mtp")
# (layer, room): a module may import its own room at its own layer, and any room below
LAYERS = [(("core",), 0, "core"), (("heads",), 1, "heads"), (ENGINE, 2, "engine"), (("artifacts",), 3, "artifacts"),
          (TARGETS_AND_VLLM, 4, "targets"), (("data",), 5, "data"), (("train",), 6, "train"),
          (("evaluation",), 6, "evaluation"), (("experiments",), 7, "experiments"),
          (("scripts",), 8, "scripts"), (("bench",), 8, "bench")]


def layer_of(module: str) -> tuple[int, str]:
    best = None
    for prefixes, layer, room in LAYERS:
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and (best is None or len(p) > best[0]):
                best = (len(p), layer, room)
    assert best is not None, f"{module}: in no room of tests/test_layout.py LAYERS"
    return best[1], best[2]


def product_modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for f in sorted((ROOT / pkg).rglob("*.py")):
            name = ".".join(f.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = f
    return out


def imports_of(path: Path, modules: dict[str, Path]) -> list[tuple[str, int]]:
    """(project module imported, line) for every import statement in the file, at any depth."""
    def resolve(name: str) -> str | None:
        while name:
            if name in modules:
                return name
            name = name.rpartition(".")[0]
        return None

    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(m, node.lineno) for a in node.names if (m := resolve(a.name))]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:  # `from pkg import module` imports the module
                m = resolve(f"{node.module}.{a.name}") if f"{node.module}.{a.name}" in modules else resolve(node.module)
                if m:
                    found.append((m, node.lineno))
    return found


def import_graph() -> dict[str, list[tuple[str, int]]]:
    modules = product_modules()
    return {m: [(d, line) for d, line in imports_of(f, modules) if d != m] for m, f in modules.items()}


def direction_violations(graph: dict[str, list[tuple[str, int]]]) -> list[str]:
    bad = []
    for m, deps in graph.items():
        layer, room = layer_of(m)
        for d, line in deps:
            dlayer, droom = layer_of(d)
            if dlayer > layer or (dlayer == layer and droom != room):
                bad.append(f"{m.replace('.', '/')}.py:{line} imports {d} ({droom}, layer {dlayer}) from {room} "
                           f"(layer {layer})")
    return bad


def cycles(graph: dict[str, list[tuple[str, int]]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w, _ in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while (w := stack.pop()) != v:
                on.discard(w)
                comp.append(w)
            on.discard(v)
            if comp:
                out.append(sorted([v, *comp]))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def package_graph(graph: dict[str, list[tuple[str, int]]]) -> dict[str, list[tuple[str, int]]]:
    """The same imports between top-level packages (a package's rooms merged)."""
    out: dict[str, set] = {}
    for m, deps in graph.items():
        out.setdefault(m.split(".")[0], set()).update((d.split(".")[0], 0) for d, _ in deps
                                                     if d.split(".")[0] != m.split(".")[0])
    return {p: sorted(ds) for p, ds in out.items()}


def test_imports_go_downward_only_and_form_no_circle():
    graph = import_graph()
    assert len(graph) > 60 and sum(map(len, graph.values())) > 200  # the parser sees the code
    assert direction_violations(graph) == []
    assert cycles(graph) == []
    assert cycles(package_graph(graph)) == []  # nor between packages: inference_eval is the engine only


def test_the_checks_catch_an_upward_import_and_a_circle():
    """The two checks on a planted graph: heads importing the engine, and a circle inside data/."""
    graph = {"heads.mtp": [("inference_eval.engine", 3)], "inference_eval.engine": [("heads.layers", 1)],
             "data.store": [("data.sources", 5)], "data.sources": [("data.store", 9)], "heads.layers": []}
    assert direction_violations(graph) == ["heads/mtp.py:3 imports inference_eval.engine (engine, layer 2) from heads "
                                           "(layer 1)"]
    assert cycles(graph) == [["data.sources", "data.store"]]
    # a package circle made of imports between different modules is one too
    assert cycles(package_graph({"data.precompute": [("inference_eval.model", 1)],
                                 "inference_eval.evaluate": [("data.prompts", 2)]})) == [["data", "inference_eval"]]
    # a same-layer import across rooms (train and evaluate share a layer) is refused too
    assert direction_violations({"train.validation": [("evaluation.evaluate", 4)]})
    # scripts/ importing experiments/ and back is the package circle the checks refuse
    assert cycles(package_graph({"experiments.study": [("scripts.stages", 1)],
                                 "scripts.study": [("experiments.study", 1)]})) == [["experiments", "scripts"]]


@pytest.mark.parametrize("pkg", ["heads"])
def test_heads_hold_networks_and_open_no_file(pkg):
    file_io = re.compile(r"\b(open|safe_open|save_file|load_file|read_text|write_text|read_bytes|write_bytes|"
                         r"mkdir|torch\.save|torch\.load|json\.load|json\.dump)\(")
    hits = [f"{f.relative_to(ROOT)}:{n}: {line.strip()}" for f in sorted((ROOT / pkg).rglob("*.py"))
            for n, line in enumerate(f.read_text().splitlines(), 1) if file_io.search(line.split("#")[0])]
    assert hits == []


def test_core_imports_nothing_of_spechead():
    graph = import_graph()
    outside = {m: [d for d, _ in deps if not d.startswith("core")] for m, deps in graph.items() if m.startswith("core")}
    assert outside and not any(outside.values()), outside


MAX_FUNCTION_LINES = 70  # ~60 lines a reader can hold, and some slack; bench/ scripts are measurements, not product


def test_no_product_function_is_long():
    long = []
    for pkg in PACKAGES:
        if pkg == "bench":
            continue
        for f in sorted((ROOT / pkg).rglob("*.py")):
            for node in ast.walk(ast.parse(f.read_text(), str(f))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    n = node.end_lineno - node.lineno + 1
                    if n > MAX_FUNCTION_LINES:
                        long.append(f"{f.relative_to(ROOT)}:{node.lineno} {node.name}: {n} lines")
    assert long == []


# A pointer `room/name.py` (or .yaml, .md) under one of the repository's top-level directories, not inside a
# longer path (`runs/x/data/a.py`, `vllm/v1/spec_decode/eagle.py`); a placeholder (`conf/head/<name>.yaml`) or a
# glob (`tests/test_*.py`) does not match.
POINTER_ROOTS = PACKAGES + ("conf", "docs", "tests")
POINTER = re.compile(r"(?<![\w./\\-])((?:%s)/[\w./-]*?\.(?:py|yaml|md))(?![\w-])" % "|".join(POINTER_ROOTS))
# another project's file named by its owner ("SGLang's `scripts/export_deepseek_nextn.py`"), not one of ours
FOREIGN = re.compile(r"(?:\w's|\ws') `?$")


def pointer_files() -> list[Path]:
    files = [f for pkg in PACKAGES + ("conf",) for f in sorted((ROOT / pkg).rglob("*"))
             if f.is_file() and f.suffix in (".py", ".yaml", ".md", ".jinja") and "__pycache__" not in f.parts]
    return (files + sorted((ROOT / "docs").glob("*.md")) + sorted((ROOT / "tests").glob("*.py"))
            + [ROOT / n for n in ("README.md", "tests/README.md", "Makefile", "pyproject.toml")])


def prose_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of a test module's comments and docstrings: its other strings are test data (a
    missing file on purpose)."""
    out, prev = [], tokenize.NEWLINE
    with path.open("rb") as f:
        for tok in tokenize.tokenize(f.readline):
            if tok.type == tokenize.COMMENT or (tok.type == tokenize.STRING and prev in STATEMENT_START):
                out += [(tok.start[0] + k, text) for k, text in enumerate(tok.string.splitlines())]
            if tok.type not in (tokenize.COMMENT, tokenize.NL):
                prev = tok.type
    return out


STATEMENT_START = (tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENCODING)


def false_pointers(path: Path) -> list[str]:
    bad = []
    lines = (prose_lines(path) if path.parent.name == "tests" and path.suffix == ".py"
             else enumerate(path.read_text().splitlines(), 1))
    for i, line in lines:
        for m in POINTER.finditer(line):
            if not (ROOT / m.group(1)).exists() and not FOREIGN.search(line[:m.start()]):
                bad.append(f"{path.relative_to(ROOT)}:{i}: {m.group(1)}")
    return bad


def test_file_pointers_are_true():
    """Every `dir/name.py` (.yaml, .md) that product code, a document, or a test's comments and docstrings
    name exists."""
    assert [b for f in pointer_files() for b in false_pointers(f)] == []


def test_the_pointer_check_catches_a_stale_pointer(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "core").mkdir()
    (tmp_path / "core" / "real.py").write_text("")
    doc = tmp_path / "core" / "doc.md"
    doc.write_text("see core/real.py and (core/gone.py), runs/x/core/gone.py, conf/head/<name>.yaml,\n"
                   "vLLM's `core/theirs.py`, tests/test_*.py; scripts/old.yaml\n")
    assert false_pointers(doc) == ["core/doc.md:1: core/gone.py", "core/doc.md:2: scripts/old.yaml"]
    (tmp_path / "tests").mkdir()
    test = tmp_path / "tests" / "test_x.py"
    test.write_text('"""Checks core/gone.py."""\n\nX = "core/missing.py"  # data; but core/old.py here is prose\n\n\n'
                    'def test_x():\n    """core/real.py"""\n    f("core/none.py")\n')
    assert false_pointers(test) == ["tests/test_x.py:1: core/gone.py", "tests/test_x.py:3: core/old.py"]


# Library functions that take the hydra config (or a section of it) instead of a typed stage config: none. The stage
# entries (experiments/stages.py) build the typed configs — PrecomputeConfig, RegenerateConfig, EvalConfig,
# TrainingPaths, EngineValidationSettings, the target's TargetConfig, the training module's ModuleSettings — and the
# library takes those; a new function that takes the config fails the test below.
TAKES_THE_CONFIG: set[tuple[str, str]] = set()
CONFIG_OK = ("scripts", "experiments", "bench", "tests", "conf")  # entry points build the typed configs here


def config_takers() -> set[tuple[str, str]]:
    """(file, function) of every product function outside the entry points with a parameter that is the hydra config
    or a section of it: named cfg / *_cfg (pcfg, rcfg, vcfg) and untyped (no annotation, Any, dict, Mapping), or
    annotated DictConfig."""
    found = set()
    for pkg in PACKAGES:
        if pkg in CONFIG_OK:
            continue
        for f in sorted((ROOT / pkg).rglob("*.py")):
            for node in ast.walk(ast.parse(f.read_text())):
                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                for a in node.args.posonlyargs + node.args.args + node.args.kwonlyargs:
                    ann = ast.unparse(a.annotation) if a.annotation is not None else ""
                    untyped = ann in ("", "Any", "typing.Any", "dict", "Mapping", "Any | None") or "DictConfig" in ann
                    named = a.arg == "cfg" or a.arg.endswith("_cfg") or a.arg in ("pcfg", "rcfg", "vcfg")
                    if (named and untyped) or "DictConfig" in ann:
                        found.add((str(f.relative_to(ROOT)), node.name))
                        break
    return found


def test_no_new_library_function_takes_the_hydra_config():
    found = config_takers()
    new = sorted(found - TAKES_THE_CONFIG)
    assert not new, (f"{new}: a library function takes the hydra config; give it a typed config built at the entry "
                     "point (experiments/stages.py), as TargetConfig and EvalConfig are")
    gone = sorted(TAKES_THE_CONFIG - found)
    assert not gone, f"{gone}: no longer take the config — remove them from TAKES_THE_CONFIG"


def test_the_config_check_catches_a_config_parameter(tmp_path, monkeypatch):
    pkg = tmp_path / "data"
    pkg.mkdir()
    (pkg / "x.py").write_text("def f(cfg):\n    pass\n\ndef g(target: 'TargetConfig'):\n    pass\n\n"
                              "def h(section: 'DictConfig | None'):\n    pass\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "PACKAGES", ("data",))
    assert config_takers() == {("data/x.py", "f"), ("data/x.py", "h")}
