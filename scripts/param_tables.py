"""The compressors' parameter tables in the docs, generated from the code: each parameter, its
default (the constructor's signature, as ``horovod-sparse list`` reads it) and what it accepts
and means (the class docstring's ``Args:`` entry). Each table sits between the markers of block
``params-NAME`` (scripts/doc_block.py) on the page :data:`PAGES` names, so that a default cannot
drift from the code: tests/unit/test_docs.py compares every block with :func:`table`.

    python scripts/param_tables.py           # rewrite every page's tables
    python scripts/param_tables.py --check   # exit 1 naming the blocks that differ from the code
"""
import argparse
import ast
import inspect
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from doc_block import markers, replace_block  # noqa: E402  (scripts/, beside this file)
from horovod_sparse import registry  # noqa: E402
from horovod_sparse.catalogue import signature_defaults  # noqa: E402
from horovod_sparse.warmup import DEFAULT_WARMUP  # noqa: E402

#: compressor (and ``auto``) -> the page that holds its table
PAGES = {
    "randomk": "docs/compressors.md", "dense": "docs/compressors.md",
    **{name: "docs/sparsifiers.md" for name in ("topk", "oktopk", "gtopk", "gaussiank", "threshold", "dgc")},
    **{name: "docs/quantizers.md" for name in ("bf16", "qsgd", "int4", "terngrad", "signsgd", "signum", "efsignsgd",
                                                "onebit")},
    "powersgd": "docs/powersgd.md", "fft": "docs/fft.md", "auto": "docs/auto.md",
}
#: a ``None`` default that the constructor resolves to a fixed value (the environment aside)
RESOLVED_NONE = {"warmup_steps": DEFAULT_WARMUP}
#: where ``auto``'s parameters are documented: the PyTorch class's docstring (read from its source,
#: so that no framework is imported); its signature is the framework-free runtime's
AUTO_DOC = ("horovod_sparse/torch/auto.py", "TorchAutoCompressor")


def block_name(name):
    return f"params-{name}"


def with_parameters():
    """Every registered compressor with a parameter, and ``auto``: the ones that need a table."""
    return [name for name in registry.available() if signature_defaults(registry.get(name))] + ["auto"]


def parameters_of(name):
    """``(defaults, docstring)`` of compressor ``name`` (or ``"auto"``)."""
    if name == "auto":
        from horovod_sparse.auto.runtime import AutoRuntime
        path, cls = AUTO_DOC
        with open(os.path.join(ROOT, path)) as f:
            node = next(n for n in ast.walk(ast.parse(f.read())) if isinstance(n, ast.ClassDef) and n.name == cls)
        return signature_defaults(AutoRuntime), ast.get_docstring(node)
    cls = registry.get(name)
    return signature_defaults(cls), inspect.getdoc(cls)


def args_section(doc):
    """``{parameter: text}`` from a Google-style ``Args:`` section (an entry may name several
    parameters, ``a, b: text``); continuation lines joined by single spaces."""
    lines = (doc or "").splitlines()
    start = next((i for i, line in enumerate(lines) if line.strip() == "Args:"), None)
    entries, indent, current = {}, None, []
    for line in lines[start + 1:] if start is not None else []:
        if not line.strip():
            continue
        depth = len(line) - len(line.lstrip())
        indent = depth if indent is None else indent
        entry = re.match(r"^(\w+(?:, \w+)*): (.*)$", line.strip()) if depth == indent else None
        if entry:
            current = [part.strip() for part in entry.group(1).split(",")]
            entries.update((parameter, entry.group(2)) for parameter in current)
        elif depth > indent and current:
            entries.update((parameter, entries[parameter] + " " + line.strip()) for parameter in current)
        else:
            break   # the section's end: a line back at the docstring's own indent
    return entries


def markdown_text(text):
    """A docstring's reST as markdown inside a table cell: roles and ``literals`` as code spans
    (``~`` keeps the last name), pipes escaped, and outside code spans the asterisks (``2**31``)."""
    text = re.sub(r":\w+:`~([^`]+)`", lambda m: f"`{m.group(1).rsplit('.', 1)[-1]}`", text)
    text = re.sub(r":\w+:`([^`]+)`", r"`\1`", text).replace("``", "`")
    parts = text.split("`")
    parts[::2] = [part.replace("*", "\\*") for part in parts[::2]]
    return "`".join(parts).replace("|", "\\|")


def default_text(parameter, value):
    if value is None and parameter in RESOLVED_NONE:
        value = RESOLVED_NONE[parameter]
    return f"`{repr(value).replace(chr(39), chr(34))}`"


def table(name):
    """The markdown table of compressor ``name``'s parameters."""
    defaults, doc = parameters_of(name)
    meaning = args_section(doc)
    missing = [p for p in defaults if p not in meaning]
    if missing:
        raise ValueError(f"{name}: the docstring's Args section does not describe {missing}")
    rows = ["| parameter | default | accepted values and meaning |", "| --- | --- | --- |"]
    rows += [f"| `{p}` | {default_text(p, v)} | {markdown_text(meaning[p])} |" for p, v in defaults.items()]
    return "\n".join(rows)


def page_block(path, name):
    """The text between block ``params-NAME``'s markers on page ``path``, or None."""
    begin, end = markers(block_name(name))
    with open(path) as f:
        doc = f.read()
    if begin not in doc or end not in doc:
        return None
    return doc.split(begin, 1)[1].split(end, 1)[0].strip("\n")


def stale():
    """``[(compressor, page)]`` whose block is missing or differs from :func:`table`."""
    return [(name, PAGES.get(name)) for name in with_parameters()
            if name not in PAGES or page_block(os.path.join(ROOT, PAGES[name]), name) != table(name)]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a table differs")
    args = parser.parse_args(argv)
    if args.check:
        differ = stale()
        for name, page in differ:
            print(f"{page or '(no page in PAGES)'}: block {block_name(name)} differs from the code", file=sys.stderr)
        return 1 if differ else 0
    for name in with_parameters():
        if name not in PAGES:
            print(f"{name}: no page in PAGES (scripts/param_tables.py) holds its table", file=sys.stderr)
            return 1
        replace_block(os.path.join(ROOT, PAGES[name]), block_name(name), table(name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
