"""The package's shape (issue 27): files short enough to read, no import cycle, the product apart from the
lab (no op or runtime module imports the benchmarks), and no environment switch but the user-facing ones.

These read the source (ast), not the imported modules: they run in a second, without Triton or a GPU.
"""

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "fuseformer"
MAX_LINES = 700
# Data, not code: the built-in tiny model and tokenizer, and the tuned config tables that
# ``python -m fuseformer.runtime.autotune ship`` writes (they grow with each GPU family tuned).
NOT_CODE = ("assets", "runtime/tuned")

# The FUSEFORMER_* variables the package reads, each a switch a user needs without editing code. A
# variable only a sweep or an experiment used is gone (issue 27); what a sweep varies is a launcher argument.
ENV_ALLOWED = {
    # Forces every op onto Triton or onto the PyTorch reference (DESIGN.md §2, "Backend choice");
    # `fuseformer info` prints it. The per-block form is fuseformer.use_backend(...).
    "FUSEFORMER_BACKEND",
    # Where tuned configs are cached (DESIGN.md §7); a GPU run points it into its output folder to ship
    # what it tuned (python -m fuseformer.runtime.autotune ship).
    "FUSEFORMER_CACHE_DIR",
    # Turns off the Hopper Gluon kernels (README: "FUSEFORMER_GLUON=0 turns them off"), for a user whose
    # Triton build or driver misbehaves with them; `fuseformer info` says whether they run.
    "FUSEFORMER_GLUON",
}


def _sources() -> dict[str, Path]:
    """Module name -> file, for every .py file of the package."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imported(module: str, path: Path, node: ast.Import | ast.ImportFrom, modules: dict) -> list[str]:
    """The package modules an import statement loads: ``from x import y`` loads x.y where that is a module,
    else x (y is then a name defined in x)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:  # relative: resolve against this module's package
            package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
            package = package[: len(package) - (node.level - 1)]
            base = ".".join(package + ([base] if base else []))
        names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
    out = []
    for name in names:
        while name and name not in modules:  # `import a.b.c` of a module loads a.b.c
            name = name.rpartition(".")[0]
        if name and name != module:
            out.append(name)
    return out


def _module_level_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Imports that run when the module is imported: at top level, and inside top-level try/with blocks
    (not under ``if TYPE_CHECKING``, not inside functions)."""
    found = []
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif isinstance(node, ast.Try):
            stack += node.body + node.orelse + node.finalbody + [n for h in node.handlers for n in h.body]
        elif isinstance(node, ast.With):
            stack += node.body
        elif isinstance(node, ast.If) and not (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"):
            stack += node.body + node.orelse
    return found


def _import_graph() -> dict[str, set[str]]:
    modules = _sources()
    graph = {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        graph[module] = {m for node in _module_level_imports(tree) for m in _imported(module, path, node, modules)}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_file_is_over_700_lines():
    too_long = {}
    for path in PACKAGE.rglob("*"):
        rel = path.relative_to(PACKAGE).as_posix()
        if not path.is_file() or "__pycache__" in rel or rel.startswith(NOT_CODE):
            continue
        lines = len(path.read_bytes().splitlines())
        if lines > MAX_LINES:
            too_long[rel] = lines
    assert not too_long, f"split these by concern (STYLE.md, one concept per file): {too_long}"


def test_the_cycle_finder_finds_cycles():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_level_import_cycle():
    graph = _import_graph()
    assert "fuseformer.ops.attention" in graph and graph["fuseformer.ops.attention"]  # the graph is read
    assert _cycles(graph) == []


def test_ops_and_runtime_never_import_the_benchmarks():
    """The product does not depend on the lab: no op or runtime module imports fuseformer.bench, not
    even inside a function (the tuning drivers live in bench/tune.py and call the ops, not the reverse)."""
    modules = _sources()
    offenders = []
    for module, path in modules.items():
        if not module.startswith(("fuseformer.ops", "fuseformer.runtime")):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in _imported(module, path, node, modules):
                    if target == "fuseformer.bench" or target.startswith("fuseformer.bench."):
                        offenders.append(f"{module}:{node.lineno} imports {target}")
    assert not offenders, offenders


_ENV_NAME = re.compile(r"FUSEFORMER_[A-Z0-9_]*")


def test_only_the_user_facing_environment_variables_are_read():
    """Every string constant that is a FUSEFORMER_* name (what os.environ.get / getenv / [] take), and
    every f-string that builds one, is in ENV_ALLOWED. Mentions in docstrings and messages are text."""
    read = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            name = None
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and _ENV_NAME.fullmatch(node.value):
                name = node.value
            elif isinstance(node, ast.JoinedStr) and node.values:
                head = node.values[0]
                if isinstance(head, ast.Constant) and isinstance(head.value, str) and _ENV_NAME.fullmatch(head.value):
                    name = head.value + "{...}"  # a name built at run time: never allowed
            if name is not None:
                read.setdefault(name, []).append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    unexpected = {name: where for name, where in read.items() if name not in ENV_ALLOWED}
    assert not unexpected, f"environment variables read but not user-facing (add to ENV_ALLOWED with why): {unexpected}"
    assert set(read) == ENV_ALLOWED, f"allowed but no longer read: {ENV_ALLOWED - set(read)}"
