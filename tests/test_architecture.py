"""The package's layers (docs/architecture.md): a module imports only modules of lower layers."""

import ast
from pathlib import Path

from conftest import ROOT

PACKAGE = ROOT / "src" / "vit_recipes"
# Bottom to top, as docs/architecture.md draws them.
LAYERS = [
    {"metric", "classifiers", "plots", "timeline"},  # import nothing of the package (metric: evaluate's, numpy only)
    {"errors", "strategies", "images", "transforms", "metrics", "patch_embedding", "flops", "meter", "interrupt"}
    | {"reports", "__init__"},
    {"arguments", "hub", "launch", "run_dir", "fp8", "patch_dropout", "levers", "figures"},
    {"data", "memory", "lora"},
    {"checks", "modeling", "card", "observability"},
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
    modules = {p.stem: p for p in PACKAGE.glob("*.py")} | {
        "metric": PACKAGE / "metric/classification/classification.py"
    }
    assert set(modules) == set(layer), "docs/architecture.md and LAYERS must name every module"
    upward = [
        f"{name} (layer {layer[name]}) imports {other} (layer {layer[other]})"
        for name, path in modules.items()
        for other in package_imports(path)
        if layer[other] >= layer[name]
    ]
    assert not upward, upward


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
