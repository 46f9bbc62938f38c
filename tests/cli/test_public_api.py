"""The front door: ``from checkpointq import ...`` is the documented, lazily imported surface.

``checkpointq.__all__``, the table in docs/api.md and the examples of README.md and docs/
stay in step: every public name is in the table and nothing else is; examples import public
names from ``checkpointq`` itself, never from a deep path. Importing a name loads only the
module that defines it, and none loads the worker's dependencies.
"""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
import tomllib
from importlib import metadata

import pytest

import checkpointq
from tests.support.markdown import ROOT, Block, all_blocks

API_PAGE = ROOT / "docs" / "api.md"
#: A row of docs/api.md's table: its first cell is a backticked name.
_ROW = re.compile(r"^\| `([A-Za-z_]+)` \|", re.MULTILINE)
#: Modules only the worker needs: a producer or a store user must never import them.
WORKER_ONLY = ("celery", "kombu", "redbeat", "prometheus_client", "rich", "billiard")
PUBLIC = [name for name in checkpointq.__all__ if name != "__version__"]


def _imported_after(statement: str) -> set[str]:
    """Top-level packages and checkpointq modules a fresh interpreter holds after ``statement``."""
    probe = f"import sys\n{statement}\nprint('\\n'.join(sorted(sys.modules)))\n"
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True
    )
    modules = done.stdout.split()
    return {m.split(".")[0] for m in modules} | {m for m in modules if m.startswith("checkpointq")}


def _python_blocks() -> list[Block]:
    return [b for b in all_blocks() if b.lang == "python"]


def _imports(block: Block) -> list[ast.ImportFrom]:
    tree = ast.parse(block.code)
    return [node for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]


def test_every_public_name_is_the_object_its_deep_path_names() -> None:
    # Given the public names, When each is read from checkpointq and from its home module,
    # Then both are the same object (the deep paths keep working and mean the same thing).
    for name in PUBLIC:
        home = checkpointq._HOMES[name]
        assert getattr(checkpointq, name) is getattr(importlib.import_module(home), name)
    assert set(checkpointq._HOMES) == set(PUBLIC)
    assert checkpointq.__all__ == sorted(checkpointq.__all__)


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        _ = checkpointq.Nope
    with pytest.raises(ImportError):
        exec("from checkpointq import Nope")


def test_version_is_the_installed_distributions_and_pyprojects() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert checkpointq.__version__ == metadata.version("checkpointq") == project["version"]


def test_importing_checkpointq_loads_none_of_its_modules() -> None:
    loaded = _imported_after("import checkpointq")
    assert {m for m in loaded if m.startswith("checkpointq.")} == set()
    assert not loaded & {"redis", "pydantic", *WORKER_ONLY}


#: The public names, grouped by the module that defines them.
BY_HOME = {
    home: sorted(n for n in PUBLIC if checkpointq._HOMES[n] == home)
    for home in sorted(set(checkpointq._HOMES.values()))
}


@pytest.mark.parametrize("home", BY_HOME)
def test_public_names_load_only_what_their_own_module_needs(home: str) -> None:
    # Given a fresh interpreter, When a module's public names are imported from checkpointq,
    # Then it holds exactly what importing them from their deep path holds: the front door
    # adds no module (no worker, no Celery for a producer that does not need it).
    names = ", ".join(BY_HOME[home])
    assert _imported_after(f"from checkpointq import {names}") == _imported_after(
        f"import checkpointq\nfrom {home} import {names}"
    )


def test_no_public_name_imports_the_workers_dependencies() -> None:
    # Given a fresh interpreter, When every public name is imported (the producer's too),
    # Then none of Celery, kombu or the worker's other dependencies is loaded: a producer
    # on a Redis broker installs and runs without checkpointq[worker].
    loaded = _imported_after(f"from checkpointq import {', '.join(PUBLIC)}")
    assert not loaded & set(WORKER_ONLY)


def test_docs_api_page_lists_exactly_the_public_names() -> None:
    assert sorted(_ROW.findall(API_PAGE.read_text())) == sorted(checkpointq.__all__)


def test_examples_import_public_names_from_the_front_door() -> None:
    # Given every Python example of README.md and docs/, When its imports are read,
    # Then names imported from checkpointq exist, and no public name comes from a deep path.
    imported: set[str] = set()
    for block in _python_blocks():
        for node in _imports(block):
            names = {alias.name for alias in node.names}
            if node.module == "checkpointq":
                assert names <= set(PUBLIC), f"{block}: {names - set(PUBLIC)} are not public"
                imported |= names
            elif (node.module or "").startswith("checkpointq."):
                deep = names & set(PUBLIC)
                assert not deep, f"{block}: import {deep} from checkpointq, not {node.module}"
    assert {"CheckpointClient", "Settings"} <= imported


#: A row of docs/api.md's field table: JSON field (plain, unlike a public name's row), then
#: ``Model.attribute``.
_FIELD_ROW = re.compile(r"^\| (\w+) \| `(\w+)\.(\w+)` \|", re.MULTILINE)


def test_the_checkpoint_fields_page_names_every_field_of_the_model_and_nothing_else() -> None:
    # Given docs/api.md's table of the checkpoint's fields, When its rows are read,
    # Then they are the models' fields, in order, each with its JSON name.
    from checkpointq.store.model import CheckpointMetadata

    documented = _FIELD_ROW.findall(API_PAGE.read_text())
    models = (checkpointq.Checkpoint, checkpointq.ConversationMessage, CheckpointMetadata)
    actual = [
        (field.alias or name, model.__name__, name)
        for model in models
        for name, field in model.model_fields.items()
    ]
    assert documented == actual
