"""The kit's one layout rule: kernel code and rank code meet only in the run folder.

``train.py``, ``rank/``, ``launcher/forkserver/`` (the process warm ranks are forked from) and every
``workers/`` folder are rank code; the exercises'
``skeletons/`` and ``solutions/`` are scripts the ranks run (the kernel copies and
reads them as files). Everything else is kernel code: it runs in the notebook and
must not pull in torch or any rank code when it is imported, and the notebooks
must not import rank code either (``lessons.script_source`` shows a script's code
by reading its file).
"""

import ast
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "ddp_tutorial"
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
#: Folders whose files run on the ranks (or are scripts the ranks run), relative to the package.
RANK_FOLDERS = ("rank", "exercises/skeletons", "exercises/solutions")
#: Notebooks known to import rank code, with the reason; each must still do so (strict xfail).


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_rank_module(name: str) -> bool:
    """Does the dotted ``name`` (a module, or a name imported from one) belong to rank code?"""
    if name == "torch" or name.startswith("torch."):
        return False  # torch is judged apart: kernel modules may import it inside a function
    parts = name.split(".")
    if parts[0] != "ddp_tutorial":
        return False
    folder = "/".join(parts[1:])
    return (parts[1:2] == ["train"] or "workers" in parts
            or any(folder == f or folder.startswith(f + "/") for f in RANK_FOLDERS))


def kernel_modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        if not is_rank_module(module_name(path)):
            yield path


def imported_names(tree: ast.AST):
    """Every module an ``import`` statement anywhere in ``tree`` names, with ``from X import a`` as
    both ``X`` and ``X.a`` (``a`` may be a submodule)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module
            yield from (f"{node.module}.{alias.name}" for alias in node.names)


def test_the_rule_sees_both_sides():
    kernel = {module_name(p) for p in kernel_modules()}
    assert {"ddp_tutorial.config", "ddp_tutorial.lessons", "ddp_tutorial.exercises.judge"} <= kernel
    assert {"ddp_tutorial.launcher.warm", "ddp_tutorial.launcher.procgroup"} <= kernel
    assert not kernel & {"ddp_tutorial.train", "ddp_tutorial.rank.original", "ddp_tutorial.rank.bootstrap",
                         "ddp_tutorial.exercises.workers.task", "ddp_tutorial.exercises.skeletons.wrap"}
    assert is_rank_module("ddp_tutorial.lessons.sampler_accumulation.workers.sampler_demo")
    assert not is_rank_module("ddp_tutorial.runfolder") and not is_rank_module("ddp_tutorial.ranking")


def test_no_kernel_module_names_a_rank_module_in_an_import():
    # Also inside functions: a rank module imported on a call runs in the kernel all the same.
    found = [f"{path.relative_to(ROOT)}: imports {name}"
             for path in kernel_modules()
             for name in imported_names(ast.parse(path.read_text(encoding="utf-8")))
             if is_rank_module(name)]
    assert found == []


_PROBE = """
import importlib, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
print("\\n".join(sorted(m for m in sys.modules if m == "torch" or m.startswith("ddp_tutorial."))))
"""


def _loaded_by(names):
    out = subprocess.run([sys.executable, "-c", _PROBE, *names], capture_output=True, text=True,
                         timeout=300, cwd=ROOT, check=True).stdout.split()
    return [m for m in out if m == "torch" or is_rank_module(m)]


_ALONE = """
import importlib, sys
for name in sys.argv[1:]:
    for loaded in [m for m in sys.modules if m == "ddp_tutorial" or m.startswith("ddp_tutorial.")]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except Exception as exc:
        print(f"{name}: {exc!r}")
"""


def test_every_kernel_module_imports_first():
    # Each one imported before anything else of the kit: an import cycle (a lesson's module that
    # imports exercises/, which imports it back) fails only in that order.
    names = [module_name(p) for p in kernel_modules()]
    out = subprocess.run([sys.executable, "-c", _ALONE, *names], capture_output=True, text=True,
                         timeout=300, cwd=ROOT, check=True).stdout
    assert out == ""


def test_importing_the_kernel_imports_neither_torch_nor_rank_code():
    names = [module_name(p) for p in kernel_modules()]
    # All of them in one fresh interpreter: nothing unwanted there means nothing in any one of them.
    if _loaded_by(names):
        culprits = {name: _loaded_by([name]) for name in names}
        assert {name: got for name, got in culprits.items() if got} == {}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_imports_no_rank_code(path):
    found = []
    for cell in nbformat.read(path, as_version=4).cells:
        if cell.cell_type != "code":
            continue
        code = "\n".join(line for line in cell.source.splitlines() if not line.lstrip().startswith(("%", "!")))
        found += [name for name in imported_names(ast.parse(code)) if is_rank_module(name)]
    assert found == [], f"{path.name} imports rank code: use lessons.script_source to show it"


#: The teacher's and the maintainer's tools: no learner's module or notebook imports them. Only the
#: commands that run them (``python -m ddp_tutorial.grade``, ``bench --notebooks/--grade``) name them.
TOOLS = ("ddp_tutorial.teacher", "ddp_tutorial.maintainer")
COMMANDS = ("ddp_tutorial.grade", "ddp_tutorial.bench")


def is_tool(name: str) -> bool:
    return any(name == t or name.startswith(t + ".") for t in TOOLS)


def test_the_learner_s_part_names_no_teacher_or_maintainer_module():
    found = [f"{path.relative_to(ROOT)}: imports {name}"
             for path in sorted(PACKAGE.rglob("*.py"))
             if not is_tool(module_name(path)) and module_name(path) not in COMMANDS
             for name in imported_names(ast.parse(path.read_text(encoding="utf-8")))
             if is_tool(name)]
    assert found == []
    assert (PACKAGE / "teacher" / "grade").is_dir() and (PACKAGE / "maintainer" / "suite.py").is_file()


def test_what_the_notebooks_import_loads_no_teacher_or_maintainer_code():
    names = sorted({name for path in NOTEBOOKS for cell in nbformat.read(path, as_version=4).cells
                    if cell.cell_type == "code"
                    for name in imported_names(ast.parse("\n".join(
                        line for line in cell.source.splitlines() if not line.lstrip().startswith(("%", "!")))))
                    if name.startswith("ddp_tutorial")})
    probe = ("import importlib, sys\nfor name in sys.argv[1:]:\n    try:\n        importlib.import_module(name)\n"
             "    except ModuleNotFoundError:\n        pass  # `from X import f`: f is no module\n"
             "print('\\n'.join(sorted(sys.modules)))")
    loaded = subprocess.run([sys.executable, "-c", probe, *names], capture_output=True, text=True,
                            timeout=300, cwd=ROOT, check=True).stdout.split()
    assert "ddp_tutorial.exercises" in loaded and "ddp_tutorial.lessons" in loaded, names
    assert [m for m in loaded if is_tool(m)] == []


def test_the_kit_finds_its_worker_scripts_in_their_own_package():
    # scripts_path(name) looks through the whole package (for a learner at a prompt); the kit's
    # modules name the folder instead, so two scripts of one name can never be confused.
    callers = [f"{path.relative_to(ROOT)}:{node.lineno}"
               for path in sorted(PACKAGE.rglob("*.py"))
               for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
               if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None))
               == "scripts_path"]
    assert callers == []
    from ddp_tutorial.lessons.worker_scripts import worker_script
    lesson = PACKAGE / "lessons" / "teardown" / "__init__.py"
    assert worker_script(str(lesson), "teardown_demo.py") == str(lesson.parent / "workers" / "teardown_demo.py")
    with pytest.raises(FileNotFoundError, match="no worker script"):
        worker_script(str(lesson), "sampler_demo.py")  # a script of another lesson
