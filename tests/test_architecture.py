"""The package's layers (docs/architecture.md): a module imports only modules of lower layers."""

import ast
from pathlib import Path

from conftest import ROOT

PACKAGE = ROOT / "src" / "vit_recipes"
# Bottom to top, as docs/architecture.md draws them.
LAYERS = [
    {"metrics", "classifiers", "plots", "timeline", "swap", "lazy_deepspeed"},  # import nothing of the package
    {"errors", "strategies", "images", "transforms", "patch_embedding", "flops", "meter", "interrupt"}
    | {"reports", "attention", "__init__"},
    {"arguments", "hub", "launch", "run_dir", "fp8", "patch_dropout", "levers", "figures", "folder_index"}
    | {"batches", "loss", "stopping"},
    {"data", "memory", "lora", "checkpoint_io"},
    {"streaming"},
    {"checks", "modeling", "card", "observability", "decoding"},
    {"plan", "adapters"},
    {"trainer"},
    {"steps"},
]


def package_imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            found.update([node.module] if node.module else [a.name for a in node.names])
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("vit_recipes"):
            found.add(node.module.split(".")[1] if "." in node.module else "")
    return {name.split(".")[0] for name in found if name}


def test_every_module_has_a_layer_and_imports_only_lower_ones():
    layer = {name: i for i, names in enumerate(LAYERS) for name in names}
    modules = {p.stem: p for p in PACKAGE.glob("*.py")}
    assert set(modules) == set(layer), "docs/architecture.md and LAYERS must name every module"
    upward = [
        f"{name} (layer {layer[name]}) imports {other} (layer {layer[other]})"
        for name, path in modules.items()
        for other in package_imports(path)
        if layer[other] >= layer[name]
    ]
    assert not upward, upward


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
    assert package_imports(PACKAGE / "arguments.py") == {"errors"}


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
    for path in PACKAGE.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                start = min([d.lineno for d in node.decorator_list] + [node.lineno])
                if node.end_lineno - start + 1 > 120:
                    long.append(f"{path.name}:{node.name} ({node.end_lineno - start + 1} lines)")
    assert not long, long


def test_run_code_patches_no_field_with_a_test_framework():
    """unittest.mock belongs to tests: a field swapped around an upstream call uses vit_recipes.core.swap.swapped."""
    users = []
    for path in [*PACKAGE.glob("*.py"), ROOT / "run_image_classification.py"]:
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
    for path in PACKAGE.glob("*.py"):
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
