"""The generated part of a markdown page: the text between ``<!-- NAME:begin -->`` and
``<!-- NAME:end -->``, rewritten by the benchmark scripts while the prose around it stays.

    >>> replace_block("docs/results/scheduling.md", "schedule", table)          # markers must exist
    >>> replace_block("docs/new.md", "results", table, heading="# Step time\\n")   # else appended
"""
import os


def markers(name):
    """The begin and end comments of block ``name``."""
    return f"<!-- {name}:begin -->", f"<!-- {name}:end -->"


def replace_block(path, name, text, heading=None):
    """Put ``text`` between the markers of block ``name`` in ``path``. Where the markers (or the
    file) are missing: with ``heading``, append ``heading`` and the block; without it,
    ValueError (the page was edited by hand; better to say so than to append a duplicate)."""
    begin, end = markers(name)
    doc = open(path).read() if os.path.exists(path) else ""
    block = f"{begin}\n{text.rstrip()}\n{end}"
    if begin in doc and end in doc:
        head, rest = doc.split(begin, 1)
        doc = head + block + rest.split(end, 1)[1]
    elif heading is not None:
        doc = (doc.rstrip() + "\n\n" if doc.strip() else "") + heading.rstrip() + "\n\n" + block + "\n"
    else:
        raise ValueError(f"{path}: no {begin} ... {end} block to replace")
    with open(path, "w") as f:
        f.write(doc)
