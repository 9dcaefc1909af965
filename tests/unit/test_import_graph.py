"""The package's import graph: no module imports one that imports it back, the library
never imports the benchmarks, and listing the compressors imports none of them.

Read from the source with ``ast`` (nothing is imported), so an import inside a function
counts as much as one at the top: a late import hides a cycle from the interpreter, not
from the design. ``from package import name`` is an edge to ``package.name`` where that
is a module, else to ``package`` itself; a package's ``__init__`` run on the way is not
counted (a package importing its own submodules would otherwise be a cycle of one).
"""
import ast
import subprocess
import sys
from pathlib import Path

import horovod_sparse

PACKAGE = Path(horovod_sparse.__file__).parent
ROOT = PACKAGE.name


def module_files():
    """``{dotted name: path}`` of every module and package under horovod_sparse."""
    files = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


def imported_modules(name, path, files):
    """The modules of ``files`` that module ``name`` (at ``path``) imports, wherever in the file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names if alias.name in files)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: level 1 is this package, 2 its parent, ...
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                if submodule in files or base in files:
                    yield submodule if submodule in files else base


def import_graph():
    """``{module: set of the package's modules it imports}``."""
    files = module_files()
    return {name: set(imported_modules(name, path, files)) - {name} for name, path in files.items()}


def find_cycle(graph):
    """One cycle as a list of modules (first == last), or None."""
    state = {}  # module -> 1 while on the DFS path, 2 when done

    def visit(node, path):
        state[node] = 1
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state:
                found = visit(target, path)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            found = visit(start, [])
            if found:
                return found
    return None


def test_the_graph_sees_late_and_relative_imports():
    graph = import_graph()
    assert f"{ROOT}.exchange.seeds" in graph[f"{ROOT}.exchange.oktopk"]  # "from .seeds import ..."
    assert f"{ROOT}.registry" in graph[ROOT]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_module_imports_one_that_imports_it_back():
    cycle = find_cycle(import_graph())
    files = module_files()
    assert cycle is None, "import cycle: " + " -> ".join(
        str(files[m].relative_to(PACKAGE.parent)) for m in cycle)


def test_the_library_never_imports_the_benchmarks():
    bench = f"{ROOT}.bench"
    offenders = sorted(m for m, targets in import_graph().items()
                       if not (m == bench or m.startswith(bench + "."))
                       and any(t == bench or t.startswith(bench + ".") for t in targets))
    assert not offenders, f"modules outside {bench} import it: {offenders}"


def test_listing_the_compressors_imports_none_of_them():
    # the table names the classes; a family (and with it mpi4py.MPI) is imported on get() only
    code = ("import sys, horovod_sparse; assert horovod_sparse.available(); "
            "print(sorted(m for m in sys.modules if m.startswith('horovod_sparse.compressors.') "
            "or m in ('mpi4py.MPI', 'torch', 'tensorflow')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_compressor_table_names_each_class_by_its_own_name():
    from horovod_sparse import registry
    for name in registry.available():
        assert registry.get(name).name == name


def test_importing_the_torch_frontend_starts_no_mpi():
    # MPI starts at the first exchange (or hvd.init()), not when the package is imported
    code = ("import sys, horovod_sparse.torch as hvds; hvds.Compression.topk; "
            "print('mpi4py.MPI' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
