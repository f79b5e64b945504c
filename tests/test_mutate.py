"""The mutation check (tools/mutate.py, `make mutate`): its list stays true to the code, and it tells a mutation the
tests catch from one they miss without touching the module it mutates."""

import json
import os
import subprocess
import sys

from conftest import ROOT

sys.path.insert(0, str(ROOT / "tools"))
import mutate  # noqa: E402


def test_every_listed_mutation_applies_once_and_names_existing_tests():
    """A mutation whose original text changed (or whose test was renamed) would be skipped as stale: fix the list
    (tools/mutations.yaml) with the change that moved it."""
    mutations = mutate.load()
    assert {name: why for m in mutations if (why := mutate.problems(m)) for name in [m.name]} == {}
    listed = {m.module for m in mutations}
    assert {"folder_index", "decoding", "streaming", "images"} <= listed
    assert all(m.removes and m.tests for m in mutations)


def test_a_mutation_is_killed_survives_or_is_stale_and_the_module_is_left_as_it_was(tmp_path):
    """A tiny repository: one module, one test that checks add() and not double()."""
    package, tests, tools = tmp_path / "src" / "vit_recipes", tmp_path / "tests", tmp_path / "tools"
    for folder in (package, tests, tools):
        folder.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    module = "def add(a, b):\n    return a + b\n\n\ndef double(x):\n    return x * 2  # x * 2\n"
    (package / "calc.py").write_text(module)
    (tests / "test_calc.py").write_text(
        "from vit_recipes.calc import add\n\ndef test_add():\n    assert add(2, 2) == 4\n"
    )
    (tests / "test_fresh.py").write_text(
        "import gc\n\ndef test_not_forked():\n    assert gc.get_freeze_count() == 0\n"
    )
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tools / "mutate.py").write_text((ROOT / "tools" / "mutate.py").read_text())
    listed = [("adds", "return a + b", "return a - b"), ("doubles", "return x * 2", "return x * 3"),
              ("gone", "return a * b", "return 0"), ("twice", "x * 2", "x"), ("broken", "return a + b", "return a +")]  # fmt: skip
    entries = [
        {"module": "calc", "id": id, "removes": id, "original": old, "replacement": new,
         "tests": ["tests/test_calc.py::test_add"]}
        for id, old, new in listed
    ]  # fmt: skip
    (tools / "mutations.yaml").write_text(json.dumps({"mutations": entries}))  # JSON is YAML
    record = tmp_path / "out" / "run.json"
    # The real package on the path too (the copy must come first); no pytest plugins to load: seconds, not ten.
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}

    def run(*args: str) -> subprocess.CompletedProcess:
        command = [sys.executable, str(tools / "mutate.py"), *args]
        return subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)

    done = run("--record", str(record))
    assert done.returncode == 1, done.stdout + done.stderr  # stale and invalid entries: the list needs fixing
    results = {r["name"]: (r["status"], r["detail"]) for r in json.loads(record.read_text())["mutations"]}
    assert results == {
        "calc/adds": ("killed", "tests/test_calc.py::test_add"),
        "calc/doubles": ("survived", ""),
        "calc/gone": ("stale", "original found 0 times in src/vit_recipes/calc.py (needs 1)"),
        "calc/twice": ("stale", "original found 2 times in src/vit_recipes/calc.py (needs 1)"),
        "calc/broken": ("invalid", "the mutated module does not compile: invalid syntax (line 2)"),
    }
    assert "calc: 1 killed, 1 survived, 2 stale, 1 invalid" in done.stdout
    assert "| calc/doubles | doubles | survived |" in record.with_suffix(".md").read_text()
    assert (package / "calc.py").read_text() == module
    assert not list(package.rglob("__pycache__"))  # nothing written beside the module either
    # A test that passes in a new interpreter but not in a fork of the tool (which froze its objects for the
    # garbage collector): each mutation then runs in a new interpreter, with the same results.
    for entry in entries:
        entry["tests"].append("tests/test_fresh.py::test_not_forked")
    (tmp_path / "fresh.yaml").write_text(json.dumps({"mutations": entries[:2]}))
    fresh = run("--list", str(tmp_path / "fresh.yaml"), "--record", str(record))
    assert fresh.returncode == 0, fresh.stdout + fresh.stderr
    assert "each mutation runs in a new interpreter: forked, the unmutated tests end otherwise" in fresh.stdout
    assert [r["status"] for r in json.loads(record.read_text())["mutations"]] == ["killed", "survived"]
    assert (package / "calc.py").read_text() == module
    check = run("--check", "--ids", "adds,gone")
    assert check.returncode == 1 and "calc/gone: original found 0 times" in check.stdout
