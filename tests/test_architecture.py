"""The package's layout and layers: a folder imports only the folders below it (docs/development.md's map), a module
only modules of lower layers (docs/architecture.md), and the model's config is read once a run."""

import ast
import re
from pathlib import Path

from conftest import ROOT

PACKAGE = ROOT / "src" / "vit_recipes"
# Each folder and the folders it may import, as docs/development.md's map draws them ("" is the package's root: the
# script's steps and the public import of load_model). No circle: checked below.
FOLDERS = {
    "core": set(),
    "data": {"core"},
    "model": {"core"},
    "plan": {"model", "data", "core"},
    "publish": {"data", "core"},
    "train": {"publish", "plan", "model", "data", "core"},
    "": {"train", "publish", "plan", "model", "data", "core"},
}
# Each module by its path in the package (folder/name), bottom to top, as docs/architecture.md draws them.
LAYERS = [
    {"core/metrics", "model/classifiers", "publish/plots", "train/timeline", "core/swap", "train/lazy_deepspeed"},
    {"core/errors", "plan/strategies", "data/images", "data/transforms", "model/patch_embedding", "model/flops"}
    | {"train/meter", "core/interrupt", "publish/reports", "model/attention", "__init__"},
    {"core/arguments", "core/hub", "core/launch", "plan/run_dir", "model/fp8", "model/patch_dropout", "model/levers"}
    | {"publish/figures", "data/folder_index", "data/batches", "train/loss", "train/stopping"},
    {"data/data", "model/lora", "train/checkpoint_io"},
    {"data/streaming", "model/facts"},
    {"plan/memory", "model/modeling", "publish/card", "train/observability", "data/decoding"},
    {"plan/checks", "model/adapters"},
    {"plan/plan", "train/trainer", "adapters"},
    {"steps"},
]


def modules() -> dict[str, Path]:
    """The package's modules by their path in it (core/errors, steps); the folders' __init__ files left out."""
    paths = [p for p in sorted(PACKAGE.rglob("*.py")) if p.name != "__init__.py" or p.parent == PACKAGE]
    return {p.relative_to(PACKAGE).with_suffix("").as_posix(): p for p in paths}


def folder_of(module: str) -> str:
    return module.rpartition("/")[0]


def package_imports(path: Path) -> set[str]:
    """The package's modules (as `modules` names them) that `path` imports, written relative or absolute."""
    here, folders = ["vit_recipes", *path.parent.relative_to(PACKAGE).parts], set(FOLDERS) - {""}
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            dotted = [alias.name.split(".") for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = here[: len(here) - node.level + 1] if node.level else []
            module = [*base, *node.module.split(".")] if node.module else base
            dotted = [[*module, alias.name] for alias in node.names]
        else:
            continue
        for parts in dotted:  # vit_recipes, then a folder and its module, or a module of the root
            if parts[0] == "vit_recipes" and len(parts) > 1:
                name = "/".join(parts[1:3]) if parts[1] in folders and len(parts) > 2 else parts[1]
                found.update([name] if (PACKAGE / f"{name}.py").is_file() else [])
    return found


def test_every_module_has_a_layer_and_imports_only_lower_ones():
    layer = {name: i for i, names in enumerate(LAYERS) for name in names}
    assert set(modules()) == set(layer), "docs/architecture.md and LAYERS must name every module"
    upward = [
        f"{name} (layer {layer[name]}) imports {other} (layer {layer[other]})"
        for name, path in modules().items()
        for other in package_imports(path)
        if layer[other] >= layer[name]
    ]
    assert not upward, upward


def test_every_folder_imports_only_the_folders_below_it():
    """The folders are docs/development.md's map: each a concern, importing only the folders its line names, with no
    circle; its __init__ says what it owns and may import, and imports nothing (a folder's import is its modules')."""
    found = {p.parent.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py")} - {"."}
    assert found == set(FOLDERS) - {""}, "a folder of the package is missing from FOLDERS (and the map), or gone"
    upward = [
        f"{name} ({folder_of(name) or 'the root'}) imports {other}"
        for name, path in modules().items()
        for other in package_imports(path)
        if folder_of(other) not in FOLDERS[folder_of(name)] | {folder_of(name)}
    ]
    assert not upward, upward
    below, left = {}, dict(FOLDERS)
    while left:  # peel the folders whose imports are all below: a circle would leave some forever
        ready = [f for f, uses in left.items() if uses <= set(below)]
        assert ready, f"the folders {sorted(left)} import each other"
        below.update({f: left.pop(f) for f in ready})
    for folder in set(FOLDERS) - {""}:
        init = ast.parse((PACKAGE / folder / "__init__.py").read_text())
        doc = ast.get_docstring(init) or ""
        assert doc and "\n\n" not in doc and len(init.body) == 1, f"{folder}/__init__.py: one paragraph, no code"
        assert "import" in doc, f"{folder}/__init__.py says what it may import"


def test_the_map_in_the_development_guide_is_the_package():
    """docs/development.md's map names every module in its folder, and each folder's imports as FOLDERS has them."""
    text = (ROOT / "docs" / "development.md").read_text()
    block = re.search(r"```\n(src/vit_recipes/\n.*?)```", text, re.S).group(1)
    drawn, imports, folder = set(), {}, None
    for line in block.splitlines()[1:]:
        if head := re.match(r"^  (\w+/|\w+\.py)\s+-> (.+)$", line):
            folder = head.group(1).rstrip("/") if head.group(1).endswith("/") else ""
            uses = head.group(2).split(":")[0].strip()
            imports[folder] = (
                set()
                if uses == "nothing"
                else set(FOLDERS) - {folder}
                if uses == "every folder"
                else {u.strip().rstrip("/") for u in uses.split(",")}
            )
        for name in re.findall(r"\b(\w+)\.py\b", line):
            drawn.add(f"{folder}/{name}".lstrip("/"))
    assert imports == FOLDERS
    assert drawn == set(modules()) - {"__init__"}


def test_the_public_import_of_load_model_still_works():
    """README.md and docs/lora.md show `from vit_recipes.adapters import load_model`; model cards name it."""
    import vit_recipes.adapters
    import vit_recipes.model.adapters

    assert vit_recipes.adapters.load_model is vit_recipes.model.adapters.load_model


def test_only_the_model_facts_read_a_models_config():
    """A run reads the model's config once, in its plan (model/facts.py's read_model_facts, into ModelFacts): a module
    that loaded it itself (the loaders, or transformers' AutoConfig.from_pretrained) would read it again."""
    readers = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            loads = isinstance(node, ast.Name) and node.id in ("load_config", "config_from_args")
            loads |= (
                isinstance(node, ast.Attribute)
                and node.attr == "from_pretrained"
                and "AutoConfig" in ast.unparse(node)
            )
            readers += [f"{name}:{node.lineno}"] if loads and name != "model/facts" else []
    assert readers == []


def test_a_run_does_not_import_evaluate():
    """A run scores with the metric's numpy arithmetic (metrics.py): evaluate's import and its Arrow copy of the logits
    cost over a second a run. Only the evaluate module around it (tools/classification/, loaded by path) imports it."""
    importers = []
    for path in [*PACKAGE.rglob("*.py"), ROOT / "run_image_classification.py"]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import | ast.ImportFrom):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                importers += [path.name for n in names if n.split(".")[0] == "evaluate"]
    assert importers == []
    assert "import evaluate" in (ROOT / "tools" / "classification" / "classification.py").read_text()


def test_arguments_import_nothing_of_ours_but_errors():
    assert package_imports(PACKAGE / "core" / "arguments.py") == {"core/errors"}


def test_every_row_of_the_reliability_table_names_a_test_that_exists():
    """docs/reliability.md stays true: each row names its test ("the same test" repeats the row above's), and each
    named `tests/<file>.py::<test>` is a test function in that file."""
    import re

    text = (ROOT / "docs" / "reliability.md").read_text()
    rows = [line for line in text.splitlines() if re.match(r"^\| \d+[a-z]? \|", line)]
    assert len(rows) > 100
    untested = [row[:80] for row in rows if "tests/" not in row.split("|")[-2] and "the same test" not in row]
    assert not untested, untested
    missing = []
    for path, name in set(re.findall(r"`(tests/\w+\.py)::(\w+)", text)):
        tree = ast.parse((ROOT / path).read_text()) if (ROOT / path).is_file() else ast.Module(body=[])
        if name not in {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}:
            missing.append(f"{path}::{name}")
    assert not missing, missing


def test_unwrapping_a_model_does_not_import_deepspeed(monkeypatch):
    """accelerate's unwrap, which the Trainer calls, imports DeepSpeed to check for its engine (0.5 s of each run):
    vit_recipes.train.lazy_deepspeed makes it check only once deepspeed is imported, as no engine exists before."""
    import sys

    import torch
    from accelerate.utils import extract_model_from_parallel

    import vit_recipes.train.trainer  # noqa: F401  imports vit_recipes.train.lazy_deepspeed, where the check is replaced

    for name in [n for n in sys.modules if n == "deepspeed" or n.startswith("deepspeed.")]:
        monkeypatch.delitem(sys.modules, name)
    model = torch.nn.Linear(2, 2)
    assert extract_model_from_parallel(model) is model and "deepspeed" not in sys.modules


def test_accelerates_unwrap_still_asks_for_deepspeed_through_the_name_we_replace():
    """The upstream shape vit_recipes.train.lazy_deepspeed relies on: accelerate's unwrap reads `is_deepspeed_available`
    from its module's globals and imports deepspeed when it answers yes. Fails when accelerate changes either: the
    patch then does nothing (find the new place) or is no longer needed (delete it)."""
    import inspect

    import accelerate.utils.imports
    import accelerate.utils.other

    from vit_recipes.train import lazy_deepspeed

    unwrap = accelerate.utils.other.extract_model_from_parallel
    assert "is_deepspeed_available" in unwrap.__code__.co_names
    assert unwrap.__globals__ is vars(accelerate.utils.other)
    assert "from deepspeed import DeepSpeedEngine" in inspect.getsource(unwrap)
    assert accelerate.utils.other.is_deepspeed_available is lazy_deepspeed.deepspeed_imported_and_installed
    assert lazy_deepspeed._installed is accelerate.utils.imports.is_deepspeed_available  # accelerate's own answer


def test_no_class_or_function_of_the_package_runs_over_120_lines():
    """A responsibility grows into its own module or class (the Trainer's mixins), not into one long body."""
    long = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                start = min([d.lineno for d in node.decorator_list] + [node.lineno])
                if node.end_lineno - start + 1 > 120:
                    long.append(f"{path.name}:{node.name} ({node.end_lineno - start + 1} lines)")
    assert not long, long


def test_run_code_patches_no_field_with_a_test_framework():
    """unittest.mock belongs to tests: a field swapped around an upstream call uses vit_recipes.core.swap.swapped."""
    users = []
    for path in [*PACKAGE.rglob("*.py"), ROOT / "run_image_classification.py"]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import | ast.ImportFrom):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                users += [path.name for n in names if n.split(".")[0] in ("unittest", "pytest")]
    assert users == []


def test_a_swapped_field_is_restored_however_the_block_ends():
    import types

    import pytest

    from vit_recipes.core.swap import swapped

    args = types.SimpleNamespace(dataloader_drop_last=True)
    with swapped(args, "dataloader_drop_last", False):
        assert args.dataloader_drop_last is False
    assert args.dataloader_drop_last is True
    with pytest.raises(KeyError), swapped(args, "dataloader_drop_last", False):
        raise KeyError
    assert args.dataloader_drop_last is True
    with pytest.raises(AttributeError), swapped(args, "renamed_upstream", 1):  # not a new field nothing reads
        pass
    assert not hasattr(args, "renamed_upstream")


def test_every_library_the_package_imports_is_a_declared_dependency():
    """A library a run imports (at the top of a module or inside a function, as --streaming's torchdata) is in
    setup.cfg's install_requires or one of its extras: a fresh `pip install` has it, not only a machine set up by
    hand."""
    import configparser
    import re
    import sys
    from importlib.metadata import packages_distributions

    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    declared = "\n".join([config["options"]["install_requires"], *config["options.extras_require"].values()])
    # Imported only where present, each saying so: its exception types (hub.is_network_error); and the
    # --fp8_backend transformer_engine build, installed by hand (checks.py names the command).
    optional = {"requests", "transformer_engine"}
    names = {re.split(r"[<>=!~ ;\[]", line.strip())[0].lower().replace("_", "-") for line in declared.splitlines()}
    found = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
    distributions = packages_distributions()
    undeclared = []
    for module in sorted(found - set(sys.stdlib_module_names) - {"vit_recipes"} - optional):
        owners = {d.lower().replace("_", "-") for d in distributions.get(module, [module])}
        if not owners & names:
            undeclared.append(f"{module} ({', '.join(sorted(owners))})")
    assert not undeclared, undeclared
