"""The docs stay honest: checks over docs/**/*.md, README.md and CHANGELOG.md (and, for the first, the code).

1. No tracker words: the project's issue tracker is internal, so words that point into it (an
   issue or stop number, a numbered or otherwise named meeting) tell a reader nothing.
   Checked in the docs, README.md, horovod_sparse/, tests/, scripts/ and studies/; every hit is listed as
   file:line. Framework sessions (pytest's ``scope="session"``, TensorFlow's ``Session``,
   ``setsid``'s process sessions) do not match: the patterns need a number or a determiner.
2. Code blocks run: a fenced ```python block whose first line is
   ``# run: mpirun -np 2 python NAME.py`` (or ``# run: horovodrun -np 2 python NAME.py``) is a
   complete program; it is written to a temporary folder as NAME.py and run there on the ranks
   the marker names (through mpirun), and must exit 0. Blocks without the marker are not run.
   A fenced block right after a ``<!-- output: NAME.py -->`` line is what rank 0 prints.
3. Links resolve: every relative markdown link points to a file or folder that exists, and its
   ``#anchor`` (into a .md page) to a heading of that page, by GitHub's slug rules.
4. Parameter tables are the code's: every compressor's table (between ``params-NAME`` markers)
   is what scripts/param_tables.py renders from its signature and docstring.
5. Headline numbers are their records': each number README.md, choosing.md, recipes.md and
   auto.md quote from the quality studies is computed here from the study's records
   (docs/results/data/accuracy/) by the scripts that made the tables, and the README's count
   and list of compressors are the registry's.
"""
import functools
import os
import re
from pathlib import Path
from urllib.parse import unquote

import pytest

from mpi_program import RUN_TIMEOUT_S, run_mpi_program

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted(ROOT.glob("docs/**/*.md")) + [ROOT / "README.md"] + sorted(ROOT.glob("CHANGELOG.md"))


def rel(path):
    path = Path(os.path.normpath(path))
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)


# ---------------------------------------------------------------------------------------------
# Markdown: fenced blocks, prose lines, headings
# ---------------------------------------------------------------------------------------------

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})\s*([^`\s]*)")


def fenced_blocks(text):
    """[(line number of the opening fence, info word, [lines inside])] of every fenced block."""
    blocks, open_block = [], None
    for number, line in enumerate(text.splitlines(), 1):
        match = FENCE.match(line)
        if open_block is None:
            if match:
                open_block = (match.group(1), number, match.group(2).lower(), [])
        elif match and match.group(1)[0] == open_block[0][0] and len(match.group(1)) >= len(open_block[0]) \
                and not match.group(2):
            blocks.append(open_block[1:])
            open_block = None
        else:
            open_block[3].append(line)
    return blocks


def prose_lines(text, code_spans=False):
    """(line number, line) of every line outside fenced blocks; inline code spans removed
    unless ``code_spans``."""
    inside = {n for start, _, body in fenced_blocks(text) for n in range(start, start + len(body) + 2)}
    for number, line in enumerate(text.splitlines(), 1):
        if number not in inside:
            yield number, line if code_spans else re.sub(r"(`+).+?\1", "", line)


def slug(heading):
    """GitHub's anchor of a heading: its rendered text lowercased, punctuation other than '-'
    and '_' dropped, each space a '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)        # links: their text
    text = re.sub(r"<[^>]+>", "", text)                                # inline HTML tags
    parts = re.split(r"(`+)(.+?)\1", text)                             # code spans keep their '_'
    rendered = []
    for i, part in enumerate(parts):
        if i % 3 == 2:
            rendered.append(part)
        elif i % 3 == 0:
            rendered.append(re.sub(r"\*\*|__|(?<!\w)_|_(?!\w)", "", part))   # emphasis marks
    text = "".join(rendered).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page):
    """Every anchor of a .md page: its headings' slugs (a repeated one gets -1, -2, ...) and
    explicit ``<a name=...>``/``id=...`` targets."""
    text = page.read_text()
    seen, found = {}, set()
    previous = ""
    for number, line in prose_lines(text, code_spans=True):
        atx = re.match(r"^ {0,3}#{1,6}\s+(.*?)\s*#*\s*$", line)
        setext = (re.match(r"^ {0,3}(=+|-+)\s*$", line) and previous.strip()
                  and not previous.lstrip().startswith(("#", "|", "-", "*", ">")))
        heading = atx.group(1) if atx else previous if setext else None
        if heading is not None:
            base = slug(heading)
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
        found.update(re.findall(r"""<a\s+(?:name|id)\s*=\s*["']([^"']+)["']""", line))
        previous = line
    return found


# ---------------------------------------------------------------------------------------------
# 1. No tracker words
# ---------------------------------------------------------------------------------------------

# Each pattern wants a number, or a word naming one particular session, so framework sessions
# pass. Written with \b before each word, so this file's own source does not match them.
TRACKER_WORDS = [re.compile(pattern, re.IGNORECASE) for pattern in (
    r"\bissues?\s*#?\d+",
    r"\bstops?\s+\d+",
    r"\bsessions?\s+\d+",
    r"\bsittings?\d*\b",                 # with a number glued on too (a folder name)
    r"\b(this|that|previous|earlier|last|next|one|same) session\b",
)]
CODE_SUFFIXES = {".py", ".sh", ".md"}


def code_files(folder):
    for path in sorted((ROOT / folder).rglob("*")):
        if path.is_file() and (path.suffix in CODE_SUFFIXES or path.name == "Makefile") \
                and "__pycache__" not in path.parts:
            yield path


AREAS = {
    "docs": lambda: [page for page in PAGES if page.name != "README.md" or page.parent != ROOT],
    "README.md": lambda: [ROOT / "README.md"],
    "Makefile": lambda: [ROOT / "Makefile"] if (ROOT / "Makefile").exists() else [],
    "horovod_sparse": lambda: list(code_files("horovod_sparse")),
    "tests": lambda: list(code_files("tests")),
    "scripts": lambda: list(code_files("scripts")),
    "studies": lambda: list(code_files("studies")),
}


def tracker_hits(paths):
    hits = []
    for path in paths:
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            words = [m.group(0) for pattern in TRACKER_WORDS for m in pattern.finditer(line)]
            if words:
                hits.append(f"{rel(path)}:{number}: {', '.join(map(repr, words))}: {line.strip()[:120]}")
    return hits


@pytest.mark.parametrize("area", list(AREAS))
def test_no_tracker_words(area):
    """Say what happened and where it is kept (a date, a file, a section), not which ticket or
    meeting it came from: readers cannot open the internal tracker."""
    hits = tracker_hits(AREAS[area]())
    assert not hits, f"{len(hits)} line(s) point into the internal tracker:\n" + "\n".join(hits)


def test_tracker_patterns_catch_tracker_words_and_pass_framework_sessions():
    """The patterns themselves: what they must catch, and framework uses they must let pass."""
    caught = ["see " + "issue" + " 19", "issue" + " #7", "Stop" + " 34", "session" + "s 23-24",
              "the " + "sit" + "ting", "/tmp/" + "sit" + "ting2/", "in " + "this" + " session",
              "the " + "previous" + " session"]
    passed = ['@pytest.fixture(scope="session")', "tf.compat.v1.Session()", "session.run(train)",
              "setsid mpirun ...", "start_new_session=True", "the same pytest session",
              "every rank issues the same allreduce", "the loop stops early"]
    assert [t for t in caught if not any(p.search(t) for p in TRACKER_WORDS)] == []
    assert [t for t in passed if any(p.search(t) for p in TRACKER_WORDS)] == []


# ---------------------------------------------------------------------------------------------
# 2. Code blocks run
# ---------------------------------------------------------------------------------------------

RUN_MARKER = re.compile(r"^#\s*run:\s*(mpirun|horovodrun)\s+-np\s+(\d+)\s+python3?\s+([\w.-]+\.py)\s*$")
def runnable_blocks():
    """pytest.params of every ```python block whose first line is a ``# run:`` comment, named
    page:line. A ``# run:`` line not of the marker's form is kept too, to fail as malformed."""
    found = []
    for page in PAGES:
        for start, info, body in fenced_blocks(page.read_text()):
            if info in ("python", "py") and body and body[0].strip().startswith("# run:"):
                found.append(pytest.param(page, start, body, id=f"{rel(page)}:{start}"))
    return found


@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
@pytest.mark.parametrize("page, start, body", runnable_blocks())
def test_code_block_runs(page, start, body, tmp_path):
    """The block is the whole program: saved under the name its marker gives and launched as the
    marker says (the ranks it names, mpirun's flags for a machine with fewer cores than ranks)."""
    marker = RUN_MARKER.match(body[0].strip())
    assert marker, (f"{rel(page)}:{start + 1}: malformed marker {body[0].strip()!r}; the form is "
                    "'# run: mpirun -np 2 python NAME.py' (or horovodrun)")
    _, ranks, name = marker.groups()
    (tmp_path / name).write_text("\n".join(body) + "\n")
    status, output = run_mpi_program(tmp_path, name, int(ranks))
    assert status == 0, (f"{rel(page)}:{start} ({name}, {ranks} ranks) exited {status}; "
                         f"output of every rank:\n{output[-6000:]}")
    shown = shown_output(page.read_text(), name)
    if shown is not None:
        # mpirun tags each chunk a rank writes, so a tag may sit inside a line: drop rank 0's
        rank0 = re.findall(r"^\[\d+,0\]<stdout>:(.*)$", output, re.MULTILINE)
        printed = [line for line in (re.sub(r"\[\d+,0\]<stdout>:", "", found) for found in rank0) if line]
        assert printed == shown, (f"{rel(page)}: what the page shows {name} printing is not what rank 0 "
                                  "printed:\n" + "\n".join(printed))


def shown_output(text, name):
    """The lines of the fenced block right after ``<!-- output: NAME -->`` on the page, or None."""
    lines = text.splitlines()
    marker = f"<!-- output: {name} -->"
    if marker not in (line.strip() for line in lines):
        return None
    after = next(i for i, line in enumerate(lines) if line.strip() == marker) + 1
    start = next(i for i in range(after, len(lines)) if lines[i].strip()) + 1   # the opening fence
    block = next(body for opening, _, body in fenced_blocks(text) if opening == start)
    return block


def test_getting_started_holds_a_runnable_block():
    """docs/getting-started.md, once written, shows at least one program the test above runs."""
    page = ROOT / "docs" / "getting-started.md"
    if not page.exists():
        pytest.skip("docs/getting-started.md is not written yet")
    blocks = [p for p in runnable_blocks() if p.values[0] == page]
    assert blocks, ("docs/getting-started.md has no ```python block starting with "
                    "'# run: mpirun -np 2 python NAME.py'")


# ---------------------------------------------------------------------------------------------
# 3. Links resolve
# ---------------------------------------------------------------------------------------------

INLINE_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^()\s<>]*)>?(?:\s+[\"'(][^)]*)?\)")
REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)")
EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")    # http:, https:, mailto:, ...


def links(page):
    """(line number, target) of every link and reference definition outside code."""
    for number, line in prose_lines(page.read_text()):
        for target in INLINE_LINK.findall(line) + REFERENCE.findall(line):
            yield number, target


def broken_link(page, target):
    """Why ``target`` on ``page`` does not resolve, or None."""
    path, _, anchor = target.partition("#")
    path, anchor = unquote(path), unquote(anchor)
    if path:
        resolved = (ROOT / path.lstrip("/")) if path.startswith("/") else (page.parent / path)
        if not resolved.exists():
            return f"no such file or folder {path}"
    else:
        resolved = page
    if anchor and resolved.suffix == ".md" and resolved.is_file() and anchor not in anchors(resolved):
        return f"no heading #{anchor} in {rel(resolved)}"
    return None


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_links_resolve(page):
    """Relative links name files or folders that exist, and anchors headings that exist."""
    broken = []
    for number, target in links(page):
        if target and not EXTERNAL.match(target):
            why = broken_link(page, target)
            if why:
                broken.append(f"{rel(page)}:{number}: ({target}) {why}")
    assert not broken, f"{len(broken)} broken link(s):\n" + "\n".join(broken)


def test_slugs_follow_github():
    assert slug("Against the targets") == "against-the-targets"
    assert slug("`max_residual_ratio` and *more*") == "max_residual_ratio-and-more"
    assert slug("1. What it does (and why)") == "1-what-it-does-and-why"
    assert slug("Foo & bar: [the link](x.md)") == "foo--bar-the-link"


# ---------------------------------------------------------------------------------------------
# 4. Parameter tables are the code's
# ---------------------------------------------------------------------------------------------

def param_tables():
    from scripts_under_test import load_script
    return load_script("param_tables")


@pytest.mark.parametrize("name", param_tables().with_parameters())
def test_parameter_table_is_the_code(name):
    """A default or a docstring changed in the code changes the page: regenerate with
    ``python scripts/param_tables.py``."""
    tables = param_tables()
    page = tables.PAGES.get(name)
    assert page, f"{name}: no page holds its parameter table; name one in PAGES (scripts/param_tables.py)"
    shown = tables.page_block(ROOT / page, name)
    begin, end = tables.markers(tables.block_name(name))
    assert shown is not None, f"{page} has no {begin} ... {end} block; run python scripts/param_tables.py"
    assert shown == tables.table(name), (f"{page}: {name}'s parameter table differs from the code; "
                                         "run python scripts/param_tables.py")


def test_parameter_tables_show_the_resolved_warmup_and_every_parameter():
    """The warm-up's ``None`` reads as the default it resolves to, and entries naming two
    parameters give each its row."""
    tables = param_tables()
    assert "| `warmup_steps` | `100` |" in tables.table("oktopk")
    assert "| `guard_momentum` | `True` |" in tables.table("auto")
    doc = "Summary.\n\nArgs:\n    a, b: shared\n        text.\n    c: own.\n\nMore prose."
    assert tables.args_section(doc) == {"a": "shared text.", "b": "shared text.", "c": "own."}


# ---------------------------------------------------------------------------------------------
# History lives in CHANGELOG.md
# ---------------------------------------------------------------------------------------------

#: phrasings of what the package did before: the guide says what it does, CHANGELOG.md what changed
HISTORY = re.compile(r"\bused to\b|\bthe default (before|then)\b|\bno longer\b|\bwas silently\b"
                     r"|\b(its|the) default now\b|\bit replaced\b|\bbefore the (redesign|on-device)", re.IGNORECASE)


def test_the_guide_states_the_present():
    """The user's guide (README.md, docs/*.md; not the dated records of docs/results/) holds no
    history; CHANGELOG.md does."""
    guide = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
    hits = [f"{rel(page)}:{number}: {line.strip()[:120]}" for page in guide
            for number, line in prose_lines(page.read_text()) if HISTORY.search(line)]
    assert not hits, "history in the guide (move it to CHANGELOG.md):\n" + "\n".join(hits)


# ---------------------------------------------------------------------------------------------
# 5. Headline numbers are their records'
# ---------------------------------------------------------------------------------------------

RECORDS = ROOT / "docs" / "results" / "data" / "accuracy"
TOLERANCE = 0.01   # the studies' target: Horovod dense's final metric within 1%
TOPK, QSGD8 = "topk:density=0.01", "qsgd:levels=127,error_feedback=true"


@functools.lru_cache(maxsize=None)
def record_numbers():
    """Every quoted figure, from the records, by recipe_study's and bench_tta's own functions:
    quality gaps (% of dense's final metric, mean over the seeds) on loopback; times to target
    measured directly on 1 Gbit/s (the run's own seconds, warm-up included) or derived (steps to
    target x bench_step's steady step)."""
    from scripts_under_test import load_script
    study, tta = load_script("recipe_study"), load_script("bench_tta")

    def tta_records(*files, recipe=None):
        recs = study.read([str(RECORDS / f) for f in files], "tta")
        return [r for r in recs if recipe is None or (r.get("recipe") or {}).get("name") == recipe]

    def gap(recs, name):
        return 100 * sum(study.gaps_to_dense(recs)[name]) / len(study.gaps_to_dense(recs)[name])

    def measured(recs, name):
        """(vs Horovod dense, vs Horovod fp16) of ``name``'s run, both sides measured."""
        higher = study.higher_of(recs)
        target = tta.target_of(recs, None, {}, TOLERANCE)[0]
        row = next(r for r in tta.summarise(recs, target, higher) if r["compressor"] == name)
        return row["vs_dense"], row["vs_fp16"]

    def derived(recs, steps_file, name, link="1gbit"):
        reach = study.reach_steps(recs, study.target_of(recs, TOLERANCE))
        times = study.step_ms(study.read([str(RECORDS / steps_file)], "step"))
        seconds = study.time_to_target(reach, times, name, link)
        return tuple(study.time_to_target(reach, times, ref, link) / seconds for ref in (study.DENSE, study.FP16))

    adamw = tta_records("adamw.jsonl", "adamw-seed1.jsonl", "adamw-seed2.jsonl")
    momentum = tta_records("momentum.jsonl", "momentum-seed1.jsonl", "momentum-seed2.jsonl")
    cluttered = tta_records("cnn-cluttered.jsonl", "cnn-cluttered-seed1.jsonl", "cnn-cluttered-seed2.jsonl")
    topk_measured = measured(tta_records("cnn-cluttered-1gbit-merge.jsonl"), TOPK)
    auto_measured = measured(tta_records("cnn-cluttered-1gbit-dense.jsonl", "cnn-cluttered-1gbit.jsonl"),
                             "auto:guard_momentum=false")
    return {
        "topk_adamw_gap": gap(adamw, TOPK),
        "topk_momentum_gap": gap(momentum, TOPK),
        "topk_cnn_gap": gap(cluttered, TOPK),
        "powersgd_adamw_gap": gap(tta_records("lm-1127.jsonl", recipe="adamw"), "powersgd:rank=2"),
        "topk_1gbit_measured": topk_measured[0],
        "topk_1gbit_derived": derived(cluttered, "step-cnn.jsonl", TOPK),
        "auto_unguarded_1gbit_measured": auto_measured[0],
        "qsgd8_1gbit_measured": measured(tta_records("adamw-1gbit.jsonl"), QSGD8),
        "qsgd8_1gbit_derived": derived(adamw, "step-adamw.jsonl", QSGD8),
    }


def quoted(numbers):
    """(page, phrase) pairs: each phrase, with the records' numbers put in, must be on the page."""
    n = numbers
    topk_d, topk_df = n["topk_1gbit_derived"]
    q_m, q_mf = n["qsgd8_1gbit_measured"]
    q_d, q_df = n["qsgd8_1gbit_derived"]
    adamw, mom, auto = n["topk_adamw_gap"], n["topk_momentum_gap"], n["auto_unguarded_1gbit_measured"]
    return [
        ("README.md", f"dense's accuracy {n['topk_1gbit_measured']:.2f}x sooner than Horovod dense, both measured at 1 Gbit/s"),
        ("README.md", f"{topk_d:.1f}x derived from the steady step"),
        ("README.md", f"ends +{mom:.1f}% over two seeds"),
        ("README.md", f"dense's quality {q_m:.1f}x sooner than Horovod dense and {q_mf:.1f}x sooner than "
                      f"Horovod fp16, all measured; {q_d:.1f}x and {q_df:.1f}x derived"),
        ("README.md", f"top-k ends +{adamw:.1f}% over three seeds, PowerSGD +{n['powersgd_adamw_gap']:.1f}%"),
        ("README.md", f"`auto(guard_momentum=False)`: {auto:.1f}x sooner than Horovod dense on ResNet-18 at "
                      "1 Gbit/s, both measured"),
        ("docs/choosing.md", f"dense's accuracy {n['topk_1gbit_measured']:.2f}x sooner than Horovod dense, both "
                             f"measured at 1 Gbit/s, top-k's warm-up included (derived from the steady step, which "
                             f"leaves the warm-up out: {topk_d:.1f}x sooner than Horovod dense, {topk_df:.1f}x sooner "
                             "than Horovod fp16)"),
        ("docs/choosing.md", f"ended +{mom:.1f}% over two seeds"),
        ("docs/choosing.md", f"dense's quality {q_m:.1f}x sooner than Horovod dense and {q_mf:.1f}x sooner than "
                             f"Horovod fp16, all measured at 1 Gbit/s (derived from the steady step: {q_d:.1f}x and "
                             f"{q_df:.1f}x)"),
        ("docs/choosing.md", f"top-k ended +{adamw:.1f}% over three seeds, PowerSGD +{n['powersgd_adamw_gap']:.1f}% "
                             "at rank 2"),
        ("docs/choosing.md", f"reached dense's accuracy {auto:.1f}x sooner than Horovod dense (both measured"),
        ("docs/recipes.md", f"| +{adamw:.1f}% (3 seeds) | +{mom:.1f}% (2 seeds) |"),
        ("docs/recipes.md", f"| `powersgd` (rank 2, the default) | +{n['powersgd_adamw_gap']:.1f}% |"),
        ("docs/recipes.md", f"top-k at 0.01 ended +{n['topk_cnn_gap']:.2f}% of dense's accuracy over three seeds"),
        ("docs/recipes.md", f"the quantizer reached dense's quality {q_m:.1f}x sooner than Horovod dense and "
                            f"{q_mf:.1f}x sooner than Horovod fp16 on the transformer, all measured (derived from "
                            f"the steady step: {q_d:.1f}x and {q_df:.1f}x)"),
        ("docs/recipes.md", f"reaches dense's accuracy {n['topk_1gbit_measured']:.2f}x sooner than Horovod dense, "
                            "both measured on the same link and VM"),
        ("docs/recipes.md", f"derived from the steady step, which leaves the warm-up out, {topk_d:.1f}x sooner "
                            f"than Horovod dense and {topk_df:.1f}x sooner than Horovod fp16"),
        ("docs/recipes.md", f"chose top-k: {auto:.1f}x sooner than Horovod dense (both measured"),
        ("docs/recipes.md", f"top-k costs {mom:.1f}% (two seeds)"),
        ("docs/recipes.md", f"+{adamw:.1f}% with it, three seeds"),
        ("docs/recipes.md", f"top-k's +{mom:.1f}% (two seeds)"),
        ("docs/auto.md", f"reaches dense's accuracy on ResNet-18 {n['topk_1gbit_measured']:.2f}x sooner than "
                         "Horovod dense, both measured"),
        ("docs/auto.md", f"top-k ends +{adamw:.1f}% on the transformer under AdamW"),
        ("docs/auto.md", f"+{n['topk_cnn_gap']:.2f}% over three seeds"),
        ("docs/auto.md", f"top-k at 0.01 ended {adamw:.1f}% (AdamW, three seeds) and {mom:.1f}% (momentum SGD, "
                         "two seeds) worse than dense"),
        ("docs/auto.md", f"{auto:.1f}x sooner than Horovod dense (both measured"),
    ]


def flat(text):
    return " ".join(text.split())


def test_headline_numbers_are_their_records():
    """A number quoted from a study is the one its records give (rounded as quoted); derived
    figures are labelled so beside the measured ones."""
    missing = [f"{page}: {phrase!r}" for page, phrase in quoted(record_numbers())
               if flat(phrase) not in flat((ROOT / page).read_text())]
    assert not missing, ("these phrases, with the records' numbers, are not on their pages (the page or "
                         "the record changed):\n" + "\n".join(missing))


def test_the_records_give_the_known_figures():
    """The computation itself, against the figures the study tables print."""
    n = record_numbers()
    assert round(n["topk_adamw_gap"], 2) == 5.38 and round(n["topk_momentum_gap"], 2) == 1.78
    assert round(n["topk_1gbit_measured"], 2) == 1.97
    assert [round(x, 2) for x in n["topk_1gbit_derived"]] == [3.84, 2.24]
    assert [round(x, 2) for x in n["qsgd8_1gbit_derived"]] == [2.03, 1.27]


def test_readme_counts_the_registry():
    """The README's "N compressors: ..." says how many the registry has and names each of them."""
    from horovod_sparse import registry
    text = (ROOT / "README.md").read_text()
    bullet = re.search(r"^- (\d+) compressors: (.*?)(?=^- |^$)", text, re.MULTILINE | re.DOTALL)
    assert bullet, "README.md has no '- N compressors: ...' bullet"
    assert int(bullet.group(1)) == len(registry.available()), \
        f"README.md says {bullet.group(1)} compressors; the registry has {len(registry.available())}"
    named = set(re.findall(r"`(\w+)`", bullet.group(2))) - {"auto"}
    assert named == set(registry.available()), (f"README.md's list lacks {sorted(set(registry.available()) - named)}"
                                                f" and names {sorted(named - set(registry.available()))} not registered")


def test_supported_versions_are_the_pins():
    """The README's "tested" column names every version scripts/versions.sh pins, on its row."""
    pins = dict(re.findall(r"^(\w+)_VERSION=(\S+)$", (ROOT / "scripts" / "versions.sh").read_text(), re.MULTILINE))
    text = (ROOT / "README.md").read_text()
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| ([^|]+?) \| ([^|]+?) \|", text.split(
        "## Supported versions", 1)[1].split("\n## ", 1)[0], re.MULTILINE)}
    row_of = {"HOROVOD": "Horovod", "TORCH": "torch", "TF": "TensorFlow, tf-keras",
              "TF_KERAS": "TensorFlow, tf-keras", "MPI4PY": "mpi4py", "NUMBA": "numba"}
    unlisted = sorted(set(pins) - set(row_of) - {"TORCHVISION"})   # torchvision: the workloads' only
    assert not unlisted, f"scripts/versions.sh pins {unlisted}: give each its row in README.md's table"
    wrong = [f"{row_of[key]}: {version}" for key, version in pins.items()
             if key in row_of and version not in rows.get(row_of[key], "")]
    assert not wrong, "README.md's supported versions lack the pinned " + ", ".join(wrong)
