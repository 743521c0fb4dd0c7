"""Every reference the prose makes resolves: paths, notebooks, `ddp_tutorial.` names, links, tables.

The prose is every notebook's markdown, README.md, notebooks/TEACHING.md, notebooks/GLOSSARY.md and
every docs/*.md. Nothing here imports torch or the package: names are resolved from the files
(their AST), torch's own files by path under its installed folder.
"""

import ast
import functools
import importlib.util
import os
import re
from pathlib import Path

import nbformat
import pytest

from ddp_tutorial.maintainer import record

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "ddp_tutorial"
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
MARKDOWN = [ROOT / "README.md", ROOT / "notebooks" / "TEACHING.md", ROOT / "notebooks" / "GLOSSARY.md",
            *sorted((ROOT / "docs").glob("*.md"))]
# A path whose first folder is one of these is named from the repository's root, exactly.
TOP = {"ddp_tutorial", "notebooks", "tests", "docs", ".ci"}
# Folders that exist only once the kit has run (the learner's work, run folders, rendered HTML).
RUNTIME = {"my_work", "runs", "rendered"}
FILE_EXT = ("py", "ipynb", "md", "sh", "toml", "txt", "hpp")

FENCE = re.compile(r"^```.*?^```", re.S | re.M)
URL = re.compile(r"https?://\S+")
FILE = re.compile(r"(?<![\w/.$-])((?:[\w.<>-]+/)*[\w<>-]+(?:\.[\w<>-]+)*\.(?:%s))(?![\w/])" % "|".join(FILE_EXT))
FOLDER = re.compile(r"(?<![\w/.$-])((?:%s)/(?:[\w.-]+/)*)(?![\w.])" % "|".join(re.escape(t) for t in TOP))
NOTEBOOK_NAME = re.compile(r"`(\d\d_[a-z_]+)`")
NOTEBOOK_REF = re.compile(r"\b[Nn]otebooks?\s+(\d\d(?:(?:\s*(?:,|and|or|to|–|-)\s*)\d\d)*)")
TOPIC_IN = re.compile(r"\b(\w+)\s+(?:is|are)\s+(?:shown\s+|measured\s+|covered\s+)?in\s+notebook\s+(\d\d)\b")
DOTTED = re.compile(r"\bddp_tutorial(?:\.[A-Za-z_]\w*)+")
SHORT = re.compile(r"`([a-z_]+)\.([A-Za-z_]\w*)(?:\.([A-Za-z_]\w*))?")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
SEPARATOR = re.compile(r"^\|?\s*:?-{3,}")


# ---------------------------------------------------------------- what the prose is
def documents() -> list:
    """(label, folder the text's links are relative to, markdown text, aliases) for all the prose."""
    docs = []
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        text = "\n\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
        code = [c.source for c in nb.cells if c.cell_type == "code"]
        docs.append((path.name, path.parent, text, aliases(code)))
    for path in MARKDOWN:
        docs.append((str(path.relative_to(ROOT)), path.parent, prose(path.read_text()), {}))
    return docs


def prose(text: str) -> str:
    """``text`` without the sections a command wrote (``--record``): its output, not prose."""
    return RECORDED.sub("", text)


RECORDED = re.compile(re.escape(record.BEGIN).replace(r"\{\}", ".*?") + ".*?"
                      + re.escape(record.END).replace(r"\{\}", ".*?"), re.S)


def aliases(code_cells) -> dict:
    """Short names a notebook's imports bind to ddp_tutorial modules (``lessons`` -> ddp_tutorial.lessons.sampler_accumulation)."""
    found = {}
    for source in code_cells:
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ddp_tutorial"):
                for alias in node.names:
                    found[alias.asname or alias.name] = f"{node.module}.{alias.name}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("ddp_tutorial"):
                        found[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else "ddp_tutorial"
    return found


# ---------------------------------------------------------------- files
@functools.lru_cache(maxsize=None)
def known_files() -> tuple:
    """Every file of the repository, and of the installed torch (as ``torch/...``), as posix paths."""
    repo = []
    for folder, subfolders, files in os.walk(ROOT):
        # not walked at all: git's, venvs' (.venv, the maintainer's .venv-torch-VERSION: thousands of files)
        subfolders[:] = [d for d in subfolders if d not in {".git", "__pycache__", "my_work", "runs"}
                         and not d.startswith(".venv")]
        repo += [(Path(folder) / f).relative_to(ROOT).as_posix() for f in files]
    spec = importlib.util.find_spec("torch")  # finds the folder; torch is not imported
    torch_dir = Path(next(iter(spec.submodule_search_locations)))
    theirs = [p.relative_to(torch_dir.parent).as_posix() for p in torch_dir.rglob("*") if p.suffix in
              (".py", ".hpp", ".h")]
    return tuple(repo), tuple(theirs)


def template(path: str) -> re.Pattern:
    """``pitfall_<name>.py`` names a family of files: any text stands for ``<name>``."""
    return re.compile("".join(".+" if part.startswith("<") else re.escape(part)
                              for part in re.split(r"(<[^>]*>)", path)) + r"\Z")


def path_resolves(path: str) -> bool:
    """True when ``path`` names a file or folder of the repository (or of torch, for its sources)."""
    path = path.rstrip("/")
    first = path.split("/")[0]
    if first in RUNTIME or path.startswith("notebooks/my_work"):
        return True
    repo, theirs = known_files()
    pattern = template(path)
    if first in TOP:  # named from the root: exactly
        return any(pattern.match(p) or p.startswith(path + "/") for p in repo)
    # a shorter path: the end of some file's path (rank/instrument.py, nn/parallel/distributed.py)
    ends = re.compile(r"(?:.*/)?" + pattern.pattern)
    return any(ends.match(p) for p in repo + theirs)


def bad_paths(text: str) -> list:
    text = re.sub(r"\]\([^)\s]+\)", "]", URL.sub("", text))  # link targets: bad_links checks them
    found = [m.group(1) for m in FILE.finditer(text)] + [m.group(1) for m in FOLDER.finditer(text)]
    return sorted({p for p in found if not path_resolves(p)})


# ---------------------------------------------------------------- notebooks by number
def notebook_numbers() -> set:
    return {p.name[:2] for p in NOTEBOOKS}


def notebook_text(number: str) -> str:
    path = next(p for p in NOTEBOOKS if p.name.startswith(number))
    return "\n".join(c.source for c in nbformat.read(path, as_version=4).cells).lower()


def bad_notebook_refs(text: str) -> list:
    bad = []
    numbers = notebook_numbers()
    for m in NOTEBOOK_REF.finditer(text):
        bad += [f"notebook {n}" for n in re.findall(r"\d\d", m.group(1)) if n not in numbers]
    names = {p.stem for p in NOTEBOOKS}
    bad += [f"`{n}`" for n in NOTEBOOK_NAME.findall(text) if n not in names]
    # "restarts are in notebook 08": the notebook named must speak of the thing said to be in it
    for m in TOPIC_IN.finditer(text):
        word, number = m.group(1).lower(), m.group(2)
        stem = word[:-1] if word.endswith("s") else word
        if number in numbers and stem not in notebook_text(number):
            bad.append(f"{m.group(0)!r}: notebook {number} never mentions {stem!r}")
    return bad


# ---------------------------------------------------------------- ddp_tutorial names
@functools.lru_cache(maxsize=None)
def module_tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def top_names(tree) -> dict:
    """Name -> the node that binds it at the top of a module or class body."""
    names = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for name in ast.walk(target):
                    if isinstance(name, ast.Name):
                        names[name.id] = node
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                names[alias.asname or alias.name.split(".")[0]] = node
        elif isinstance(node, (ast.If, ast.Try)):  # names bound under a guard
            for sub in ast.walk(node):
                if isinstance(sub, (ast.FunctionDef, ast.ClassDef)):
                    names.setdefault(sub.name, sub)
    return names


def module_file(dotted: str):
    """The file of module ``dotted`` (a package's __init__.py), or None."""
    path = ROOT.joinpath(*dotted.split("."))
    if (path / "__init__.py").is_file():
        return path / "__init__.py"
    if path.with_suffix(".py").is_file():
        return path.with_suffix(".py")
    return None


def name_resolves(dotted: str) -> bool:
    """Whether ``ddp_tutorial.a.b.c`` names a module, or a name bound in one (a class's attribute too)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):  # the longest prefix that is a module
        path = module_file(".".join(parts[:cut]))
        if path is not None:
            break
    else:
        return False
    rest = parts[cut:]
    if not rest:
        return True
    names = top_names(module_tree(path))
    node = names.get(rest[0])
    if node is None:
        return False
    if len(rest) == 1:
        return True
    if isinstance(node, ast.ClassDef):
        members = top_names(node)
        # attributes set on self in methods count too (run.summaries)
        members.update({t.attr: t for t in ast.walk(node) if isinstance(t, ast.Attribute)
                        and isinstance(t.value, ast.Name) and t.value.id == "self"})
        return rest[1] in members
    if isinstance(node, ast.ImportFrom):  # from x import y (the package imports absolutely): follow it
        original = next(a.name for a in node.names if (a.asname or a.name) == rest[0])
        return name_resolves(".".join([node.module, original, *rest[1:]]))
    return True  # an attribute of a value: not checked further


@functools.lru_cache(maxsize=None)
def package_modules() -> dict:
    """Short module name -> every dotted module of the package that has it (``timing`` -> rank.timing)."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        if {"skeletons", "solutions"} & set(path.parts):
            continue  # the learner's scripts: `sampler.set_epoch` in the prose is torch's, not skeletons/sampler.py
        dotted = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        if path.name == "__init__.py":
            dotted = dotted.rsplit(".", 1)[0]
        found.setdefault(dotted.rsplit(".", 1)[-1], []).append(dotted)
    return found


def bad_names(text: str, alias: dict) -> list:
    bad = [m.group(0) for m in DOTTED.finditer(text) if not name_resolves(m.group(0))]
    for m in SHORT.finditer(text):
        short, attr, more = m.groups()
        if attr in FILE_EXT or attr in ("jsonl", "json", "pt", "png", "com", "html", "csv"):
            continue
        modules = [alias[short]] if short in alias else package_modules().get(short, [])
        if not modules:
            continue  # not one of ours (dist.barrier, torch.save, os.replace ...)
        tail = [attr] + ([more] if more else [])
        if not any(name_resolves(".".join([module, *tail])) for module in modules):
            bad.append(f"{short}.{'.'.join(tail)}")
    return sorted(set(bad))


# ---------------------------------------------------------------- links
def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(text: str) -> set:
    text = FENCE.sub("", text)
    found = set()
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*$", text, re.M):
        found |= {slug(heading), heading.strip().replace(" ", "-")}  # GitHub's, and Jupyter's
    return found


def target_text(path: Path) -> str:
    if path.suffix == ".ipynb":
        return "\n\n".join(c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "markdown")
    return path.read_text()


def bad_links(text: str, folder: Path) -> list:
    bad = []
    for target in LINK.findall(FENCE.sub("", text)):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        file, _, anchor = target.partition("#")
        path = (folder / file).resolve() if file else None
        if path is not None and not path.exists():
            bad.append(target)
        elif anchor and (path is None or path.suffix in (".md", ".ipynb")):
            if anchor not in anchors(target_text(path) if path else text):
                bad.append(target)
    return bad


# ---------------------------------------------------------------- tables
def cells(row: str) -> int:
    row = re.sub(r"`[^`]*`", "code", row.strip())  # a | inside code is not a border
    row = row.replace(r"\|", "")
    return len(row.strip("|").split("|"))


def bad_tables(text: str) -> list:
    bad = []
    lines = FENCE.sub("", text).splitlines()
    for i, line in enumerate(lines[:-1]):
        if line.lstrip().startswith("|") and SEPARATOR.match(lines[i + 1].strip()) and \
                (i == 0 or not lines[i - 1].lstrip().startswith("|")):
            width = cells(line)
            for row in lines[i + 1:]:
                if not row.lstrip().startswith("|"):
                    break
                if cells(row) != width:
                    bad.append(f"{cells(row)} cells, header {width}: {row[:100]}")
    return bad


# ---------------------------------------------------------------- the tests
DOCUMENTS = documents()
IDS = [d[0] for d in DOCUMENTS]


@pytest.mark.parametrize("label, folder, text, alias", DOCUMENTS, ids=IDS)
def test_every_repository_path_exists(label, folder, text, alias):
    assert bad_paths(text) == []


@pytest.mark.parametrize("label, folder, text, alias", DOCUMENTS, ids=IDS)
def test_every_notebook_reference_exists_and_covers_its_topic(label, folder, text, alias):
    assert bad_notebook_refs(text) == []


@pytest.mark.parametrize("label, folder, text, alias", DOCUMENTS, ids=IDS)
def test_every_ddp_tutorial_name_resolves(label, folder, text, alias):
    assert bad_names(text, alias) == []


@pytest.mark.parametrize("label, folder, text, alias", DOCUMENTS, ids=IDS)
def test_every_relative_link_resolves(label, folder, text, alias):
    assert bad_links(text, folder) == []


@pytest.mark.parametrize("label, folder, text, alias", DOCUMENTS, ids=IDS)
def test_every_table_row_has_as_many_cells_as_its_header(label, folder, text, alias):
    assert bad_tables(text) == []


def test_the_prose_is_all_read():
    labels = set(IDS)
    assert {p.name for p in NOTEBOOKS} <= labels and {"README.md", "notebooks/GLOSSARY.md"} <= labels
    assert len(NOTEBOOKS) >= 10


# The checks find the mistakes that were once in the prose (each line is one of them).
@pytest.mark.parametrize("text, check", [
    ("through a small `hooks` object (`ddp_tutorial/instrument.py`)", bad_paths),
    ("the original's version of one function (`ddp_tutorial/original.py`)", bad_paths),
    ("Notebook 05 returns to leftover processes; restarts are in notebook 07.", bad_notebook_refs),
    ("see notebook 12", bad_notebook_refs),
    ("`ddp_tutorial.lessons.no_such_helper`", lambda t: bad_names(t, {})),
    ("`lessons.straggler_wait_secs` computes it", lambda t: bad_names(t, {"lessons": "ddp_tutorial.lessons.sampler_accumulation"})),
    ("the [glossary](GLOSSARY.md#no-such-entry)", lambda t: bad_links(t, ROOT / "notebooks")),
    ("the [guide](nowhere.md)", lambda t: bad_links(t, ROOT)),
    ("| what | measured | target |\n| --- | --- | --- |\n| a | b | c | c |\n", bad_tables),
])
def test_the_checks_catch_the_old_mistakes(text, check):
    assert check(text) != []


@pytest.mark.parametrize("text, check", [
    ("`ddp_tutorial/rank/instrument.py`, `rank/original.py`, `pitfall_<name>.py`, `my_work/init.py`", bad_paths),
    ("torch's `nn/parallel/distributed.py` and `distributed_c10d.py`", bad_paths),
    ("restarts are in notebook 08; notebooks 01–05", bad_notebook_refs),
    ("`ddp_tutorial.launch`, `ddp_tutorial.rank.timing.SyncTimer`, `timing.SyncTimer`",
     lambda t: bad_names(t, {})),
    ("the [checks](TEACHING.md#what-the-checks-say)", lambda t: bad_links(t, ROOT / "notebooks")),
    ("| a | `x|y` |\n| --- | --- |\n| 1 | 2 |\n", bad_tables),
])
def test_the_checks_accept_what_is_right(text, check):
    assert check(text) == []


def test_every_docs_page_is_linked_from_the_readme():
    readme = (ROOT / "README.md").read_text()
    for page in sorted((ROOT / "docs").glob("*.md")):
        assert f"](docs/{page.name}" in readme, f"README does not link docs/{page.name}"


def test_the_hang_checklist_is_one_place_linked_from_the_notebooks_that_hang():
    glossary = (ROOT / "notebooks" / "GLOSSARY.md").read_text()
    assert "my-job-hangs-a-checklist" in anchors(glossary)
    linked = {label[:2] for label, _, text, _ in DOCUMENTS
              if label.endswith(".ipynb") and "GLOSSARY.md#my-job-hangs-a-checklist" in text}
    assert {"01", "05", "08", "09"} <= linked, linked
    for cause in ("wrong world size", "a collective one rank skips", "uneven inputs", "a dead peer",
                  "mismatched shapes"):
        assert f"| {cause}" in glossary, cause
