#!/usr/bin/env python
"""Does a test fail when a behaviour is removed? Applies each listed one-line mutation (tools/mutations.yaml), one at
a time, and runs the fast tests named for it: killed (a test failed), survived (every test passed: no test guards
that behaviour), stale (its original text is not in the module exactly once: the list needs updating).

    make mutate MODULES=folder_index,decoding                       # or: python tools/mutate.py --modules ...
    python tools/mutate.py --ids images/alpha-on-white,streaming/repeats
    python tools/mutate.py --check                                  # the list alone: stale entries, unknown tests

General tools (mutmut, cosmic-ray) generate hundreds of mutants per module and run the tests for each: hours with
this suite. Here each mutation removes one behaviour a developer named, with the few tests that should catch it.

Each mutation runs on its own copy of src/ (the worktree is never written: an interrupted run leaves nothing to
restore), first on the path, with its own datasets cache (a mutated run must not leave a decoded copy that a later
run would reuse) and pytest folder; its tests stop at the first failure. First the selected mutations' tests run
once unmutated, in a new interpreter (the baseline): a mutation whose tests fail there is "not run", never "killed".
Most of a run's time is importing torch, transformers and datasets, so this process then imports the libraries the
baseline imported (never vit_recipes or the tests), and each mutation's run is a fork of it that imports only the
mutated copy and the tests: seconds, not a minute, each. The baseline runs forked too, and must end as it did in the
new interpreter; else, or with --fresh, each mutation runs in a new interpreter.
The record (JSON, and markdown beside it) goes to --record.
"""

import argparse
import ast
import compileall
import contextlib
import datetime
import functools
import gc
import importlib
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
LIST = ROOT / "tools" / "mutations.yaml"
RECORD = ROOT / "outputs" / "mutate" / "last.json"
FIELDS = ("module", "id", "removes", "original", "replacement", "tests")
STATUSES = ("killed", "survived", "stale", "invalid", "not run", "error")
WRONG_SOURCE = 99  # a run's exit code when the package did not come from its copy of src/


@dataclass
class Mutation:
    # a module of src/vit_recipes: its name (decoding), found in whichever folder holds it, or folder/name where
    # two share a name (model/adapters); or a path under src/ (src/vit_recipes/data/decoding.py)
    module: str
    id: str  # unique within its module; cited as module/id
    removes: str  # the behaviour the mutation removes, in one line
    original: str  # text within one line of the module, found there exactly once
    replacement: str
    tests: list[str]  # pytest node ids (tests/test_x.py::test_name) or test files
    k: str | None = None  # optional -k expression on top of `tests`

    @property
    def name(self) -> str:
        return f"{self.module}/{self.id}"

    @property
    def path(self) -> Path:
        """The module's file (see `module`)."""
        package = ROOT / "src" / "vit_recipes"
        if self.module.startswith("src/"):
            return ROOT / self.module
        found = [package / f"{self.module}.py"] if "/" in self.module else sorted(package.rglob(f"{self.module}.py"))
        return found[0] if len(found) == 1 else package / f"{self.module}.py"  # two of one name: not found there


@dataclass
class Result:
    name: str
    removes: str
    status: str = ""  # one of STATUSES
    detail: str = ""  # the first failing test (killed), or why (the others)
    seconds: float = 0.0
    tests: list[str] = field(default_factory=list)


def load(path: Path = LIST) -> list[Mutation]:
    """The listed mutations, checked for shape (`problems` checks them against the code)."""
    try:
        entries = yaml.safe_load(path.read_text())["mutations"]
    except (yaml.YAMLError, KeyError, TypeError) as err:
        raise SystemExit(f"error: {path} is not a list of mutations: {' '.join(str(err).split())}") from None
    mutations, seen = [], set()
    for n, entry in enumerate(entries):
        missing, unknown = [k for k in FIELDS if k not in entry], sorted(set(entry) - set(FIELDS) - {"k"})
        if missing or unknown:
            raise SystemExit(
                f"error: {path.name} entry {n + 1} ({entry.get('id')}): missing {missing}, unknown {unknown}"
            )
        mutation = Mutation(**{**entry, "tests": list(entry["tests"])})
        if mutation.name in seen:
            raise SystemExit(f"error: {path.name}: {mutation.name} is listed twice")
        seen.add(mutation.name)
        mutations.append(mutation)
    return mutations


def tests_in(test_file: Path) -> set[str]:
    """The test functions of a test file, as node ids name them (test_x, TestY::test_x), read without importing it."""
    return _tests_in(test_file, test_file.stat().st_mtime_ns)


@functools.cache
def _tests_in(test_file: Path, mtime: int) -> set[str]:
    names = set()
    for node in ast.parse(test_file.read_text()).body:
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test"):
            names.add(node.name)
        elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            names |= {f"{node.name}::{f.name}" for f in node.body if isinstance(f, ast.FunctionDef)}
    return names


def unknown_tests(tests: list[str]) -> list[str]:
    """The node ids among `tests` whose file or test function does not exist (a parametrized id by its function)."""
    unknown = []
    for test in tests:
        file, _, name = test.partition("::")
        path = ROOT / file
        if not path.is_file() or name and re.sub(r"\[.*\]$", "", name) not in tests_in(path):
            unknown.append(test)
    return unknown


def stale(mutation: Mutation) -> str:
    """Why the mutation cannot apply to the module as it is now ("" when it can)."""
    if "\n" in mutation.original or "\n" in mutation.replacement:
        return "original and replacement must each be within one line"
    if mutation.original == mutation.replacement:
        return "the replacement is the original"
    if not mutation.path.is_file() or not mutation.path.is_relative_to(ROOT / "src"):
        return f"no module {mutation.path.relative_to(ROOT)} under src/"
    count = mutation.path.read_text().count(mutation.original)
    return "" if count == 1 else f"original found {count} times in {mutation.path.relative_to(ROOT)} (needs 1)"


def problems(mutation: Mutation) -> str:
    """What makes a listed mutation unusable now: stale, or a test that does not exist."""
    if why := stale(mutation):
        return why
    if unknown := unknown_tests(mutation.tests):
        return f"no such test: {', '.join(unknown)}"
    return ""


# ------------------------------------------------------------------------------------------------------- running


def _pytest(src: Path, args: list[str], probe: str = "") -> int:
    """pytest.main in this (new or forked) process with `src` first on the path. `probe`: a file for the libraries
    the run imported and the environment as the test modules left it (tests/conftest.py sets HF_HUB_OFFLINE)."""
    sys.path[:0] = [str(src), str(ROOT / "src")]
    sys.dont_write_bytecode = True
    os.chdir(ROOT)
    if "datasets.config" in sys.modules:  # read at import, by the process this one was forked from
        sys.modules["datasets.config"].HF_DATASETS_CACHE = Path(os.environ["HF_DATASETS_CACHE"])
    package = importlib.util.find_spec("vit_recipes")
    if package is None or not Path(package.origin).is_relative_to(src):
        print(f"vit_recipes would come from {package and package.origin}, not {src}", flush=True)
        return WRONG_SOURCE
    import pytest

    seen = {}

    class Probe:
        def pytest_collection_finish(self, session):
            seen["env"] = dict(os.environ)

    code = int(pytest.main(args, plugins=[Probe()]))
    if probe:
        files = {n: getattr(m, "__file__", None) for n, m in list(sys.modules.items()) if not n.startswith("__")}
        Path(probe).write_text(
            json.dumps({"modules": {n: f for n, f in files.items() if f}, "env": seen.get("env", {})})
        )
    return code


class Job:
    """One pytest run on `tests` with `src` first on the path, in its own folder (datasets cache, pytest's tmp)."""

    def __init__(self, tests: list[str], k: str | None, src: Path, work: Path, stop_first: bool, collect_only=False):
        self.src, self.work, self.output = src, work, work / "output.txt"
        # A mutation's run stops at its first failure (-x) and needs no assertion's detail: pytest's rewriting of the
        # test files' asserts costs more than their tests (--assert=plain; the baseline keeps it, to show a failure).
        quick = ["-x", "--assert=plain"] if stop_first else []
        self.args = [*tests, *(["--collect-only"] if collect_only else []), "-q", "-p", "no:cacheprovider", "-p",
                     "no:xdist", "--basetemp", str(work / "pytest"), "-rfE", *quick, *(["-k", k] if k else [])]  # fmt: skip
        path = [str(src), str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])]
        self.env = {"HF_DATASETS_CACHE": str(work / "hf_datasets"), "PYTHONPATH": os.pathsep.join(path)}
        self.pid, self.process, self.started = 0, None, 0.0

    def start(self, fork: bool, probe: Path | None = None) -> None:
        """In a fork of this process (see the module docstring), or a new interpreter (`probe`: it lists its imports)."""
        self.started = time.monotonic()
        if not fork:
            command = [sys.executable, __file__, "--child", str(self.src), str(probe or ""), *self.args]
            with open(self.output, "w") as output:
                self.process = subprocess.Popen(command, cwd=ROOT, env={**os.environ, **self.env}, stdout=output,
                                                stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
            self.pid = self.process.pid
            return
        sys.stdout.flush()
        sys.stderr.flush()
        self.pid = os.fork()
        if self.pid == 0:  # the child: its own session (a timeout kills all it started), its output to the file
            code = 3
            try:
                os.setsid()
                out = os.open(self.output, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                os.dup2(out, 1)
                os.dup2(out, 2)
                os.environ.update(self.env)  # processes the tests launch import the copy too
                code = _pytest(self.src, self.args)
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)

    def poll(self, timeout: float) -> tuple[bool, int | None]:
        """(ended, exit code: None after a timeout, which kills the run and all it started)."""
        if self.process is not None:
            code = self.process.poll()
        else:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            code = None if pid == 0 else os.waitstatus_to_exitcode(status)
        if code is not None:
            return True, code
        if time.monotonic() - self.started < timeout:
            return False, None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)
        self.process.wait() if self.process is not None else os.waitpid(self.pid, 0)
        return True, None

    def failed(self) -> tuple[list[str], str]:
        """The failing tests' ids, and the run's output."""
        text = self.output.read_text(errors="replace") if self.output.exists() else ""
        return re.findall(r"^(?:FAILED|ERROR) (\S+)", text, flags=re.M), text


def ours(name: str, file: str) -> bool:
    """A module of this repository (vit_recipes, the tests, tools/, the script): never imported before a fork."""
    return (
        name.split(".")[0] in ("vit_recipes", "conftest")
        or Path(file).resolve().is_relative_to(ROOT)
        or (f"{os.sep}mutate-" in file)
    )


@contextlib.contextmanager
def _quiet():
    """What libraries print while imported, to /dev/null. The files 1 and 2, not sys.stdout: a log handler made now
    keeps the sys.stdout it saw, which in a child must be the child's output."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved, null = (os.dup(1), os.dup(2)), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.dup2(null, 2)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, null):
            os.close(fd)


def preload(probe: Path) -> str:
    """Import what the baseline imported, none of ours, in the environment its tests ran in; "" when this process
    can then be forked, else why not."""
    found = json.loads(probe.read_text())
    for key, value in found["env"].items():
        if key not in os.environ and key != "PYTEST_CURRENT_TEST":
            os.environ[key] = value
    with _quiet():
        for name, file in found["modules"].items():
            if name not in sys.modules and not ours(name, file):
                with contextlib.suppress(Exception):  # one a library imports only in some setting, say
                    importlib.import_module(name)
    if leaked := [name for name in sys.modules if name.split(".")[0] == "vit_recipes"]:
        return f"a library imported {leaked[0]}"
    if threading.active_count() > 1:  # a fork copies only this thread: a lock another held would never be released
        return f"a library started a thread ({', '.join(t.name for t in threading.enumerate()[1:])})"
    gc.freeze()  # out of the children's collections: pytest's closing gc.collect()s took 9 s of each run's 14
    return ""


def prepare(mutation: Mutation, result: Result) -> str | None:
    """The mutated module's text, or None with the result's status set (stale, error, invalid)."""
    if why := problems(mutation):
        result.status, result.detail = ("stale" if stale(mutation) else "error"), why
        return None
    mutated = mutation.path.read_text().replace(mutation.original, mutation.replacement)
    try:
        compile(mutated, str(mutation.path), "exec")
    except SyntaxError as err:
        result.status, result.detail = "invalid", f"the mutated module does not compile: {err.msg} (line {err.lineno})"
        return None
    return mutated


def judge(result: Result, code: int | None, failed: list[str], output: str, timeout: float) -> None:
    if code is None:
        result.status, result.detail = "killed", f"timeout after {timeout:g} s (the tests hang without it)"
    elif code in (1, 2):  # tests failed, or collection failed (the module no longer imports)
        result.status, result.detail = "killed", failed[0] if failed else "collection error"
    elif code == 0:
        result.status = "survived"
    else:
        lines = output.strip().splitlines()
        result.status, result.detail = "error", f"exit {code}: {lines[-1] if lines else 'no output'}"


def compiled_copy(folder: Path) -> Path:
    """src/ copied into `folder` and compiled once: each mutation's copy of it imports faster."""
    shutil.copytree(ROOT / "src", folder / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    compileall.compile_dir(folder / "src", quiet=2)
    return folder / "src"


def wait(job: Job, timeout: float) -> tuple[int | None, list[str], str]:
    """The job's exit code (None: timed out), failing tests and output, once it ends."""
    while not (ended := job.poll(timeout))[0]:
        time.sleep(0.2)
    return ended[1], *job.failed()


def run_mutations(mutations, template: Path, timeout: float, jobs: int, fork: bool, keep: Path | None, report):
    """Each mutation on its own copy of `template` (src/), `jobs` at a time; `report(result)` as each ends."""
    pending, running = list(mutations), []
    try:
        while pending or running:
            while pending and len(running) < jobs:
                mutation = pending.pop(0)
                result = Result(mutation.name, mutation.removes, tests=mutation.tests)
                if (mutated := prepare(mutation, result)) is None:
                    report(result)
                    continue
                work = Path(tempfile.mkdtemp(prefix="mutate-"))
                shutil.copytree(
                    template, work / "src"
                )  # compiled modules too, valid: copies keep their sources' times
                target = work / "src" / mutation.path.relative_to(ROOT / "src")
                target.write_text(mutated)
                for compiled in target.parent.glob(f"__pycache__/{target.stem}.*.pyc"):
                    compiled.unlink()
                job = Job(mutation.tests, mutation.k, work / "src", work, stop_first=True)
                job.start(fork)
                running.append((job, result, mutation))
            time.sleep(0.1)
            for entry in list(running):
                job, result, mutation = entry
                ended, code = job.poll(timeout)
                if not ended:
                    continue
                running.remove(entry)
                failed, output = job.failed()
                result.seconds = round(time.monotonic() - job.started, 1)
                judge(result, code, failed, output, timeout)
                if keep is not None:
                    (keep / f"{mutation.name.replace('/', '--')}.txt").write_text(output)
                shutil.rmtree(job.work, ignore_errors=True)
                report(result)
    finally:
        for job, _, _ in running:  # interrupted: end the runs still going
            with contextlib.suppress(ProcessLookupError):
                os.killpg(job.pid, signal.SIGKILL)
            shutil.rmtree(job.work, ignore_errors=True)


def baseline(mutations: list[Mutation], timeout: float, probe: Path, collect_only: bool = False):
    """The mutations' tests, unmutated, in a new interpreter, every one (no -x): (exit code, failing ids, output),
    and in `probe` the libraries they imported (collect_only: those the test modules import)."""
    tests = sorted({t for m in mutations for t in m.tests if not unknown_tests([t])})
    work = Path(tempfile.mkdtemp(prefix="mutate-"))
    try:
        job = Job(tests, None, ROOT / "src", work, stop_first=False, collect_only=collect_only)
        job.start(fork=False, probe=probe)
        return wait(job, timeout * 3)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def forks_agree(mutations: list[Mutation], template: Path, timeout: float, code: int, failing: list[str]) -> str:
    """The baseline again, forked: "" when it ends as in a new interpreter, else how it differs."""
    tests = sorted({t for m in mutations for t in m.tests if not unknown_tests([t])})
    work = Path(tempfile.mkdtemp(prefix="mutate-"))
    try:
        job = Job(tests, None, template, work, stop_first=False)
        job.start(fork=True)
        forked, failed, _ = wait(job, timeout * 3)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if forked == code and sorted(failed) == sorted(failing):
        return ""
    return f"forked, the unmutated tests end otherwise (exit {forked}, failing {', '.join(failed) or 'none'})"


def touches(mutation: Mutation, failing: list[str]) -> list[str]:
    """The failing baseline tests among a mutation's (a file, or a -k selection, touches every failing test in it)."""
    hits = []
    for test in mutation.tests:
        prefix = test if "::" in test and not mutation.k else test.partition("::")[0]
        hits += [f for f in failing if f == prefix or f.startswith((prefix + "::", prefix + "["))]
    return hits


# ------------------------------------------------------------------------------------------------------- reporting


def summary(results: list[Result]) -> dict[str, dict[str, int]]:
    modules: dict[str, dict[str, int]] = {}
    for r in results:
        counts = modules.setdefault(r.name.rsplit("/", 1)[0], {})
        counts[r.status] = counts.get(r.status, 0) + 1
    return modules


def _git(*args: str) -> str:
    done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
    return done.stdout.rstrip() if done.returncode == 0 else ""  # not strip(): porcelain lines start with a space


def write_record(path: Path, results: list[Result], mutations: list[Mutation], command: str, seconds: float) -> None:
    """The run as JSON at `path` and as markdown beside it: the commit and any uncommitted change to what it read."""
    files = sorted({str(m.path.relative_to(ROOT)) for m in mutations} | {str(LIST.relative_to(ROOT))})
    record = {
        "command": command,
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "commit": _git("rev-parse", "HEAD"),
        "uncommitted": [line[3:] for line in _git("status", "--porcelain", "--", *files).splitlines()],
        "seconds": round(seconds),
        "summary": summary(results),
        "mutations": [asdict(r) for r in results],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")
    lines = [f"# Mutation run, {record['date']}", "", f"`{command}` at {record['commit'] or 'an unknown commit'}"]
    if record["uncommitted"]:
        lines[-1] += f", with uncommitted changes to {', '.join(record['uncommitted'])}"
    lines += ["", "| module | " + " | ".join(STATUSES) + " |", "|---" * (len(STATUSES) + 1) + "|"]
    lines += [
        f"| {m} | " + " | ".join(str(c.get(s, 0)) for s in STATUSES) + " |" for m, c in record["summary"].items()
    ]
    lines += ["", "| mutation | removes | result | by / why | s |", "|---|---|---|---|---|"]
    lines += [
        f"| {r.name} | {r.removes} | {r.status} | {r.detail.replace('|', '/')} | {r.seconds:g} |" for r in results
    ]
    path.with_suffix(".md").write_text("\n".join(lines) + "\n")


def print_result(r: Result) -> None:
    took = f"  ({r.seconds:g} s)" if r.seconds else ""
    print(f"{r.status.upper():9} {r.name:44} {r.detail or r.removes}"[:220] + took, flush=True)


def select(mutations: list[Mutation], modules: str | None, ids: str | None) -> list[Mutation]:
    if modules:
        wanted = set(modules.split(","))
        if unknown := wanted - {m.module for m in mutations}:
            raise SystemExit(f"error: no mutations listed for {', '.join(sorted(unknown))}")
        mutations = [m for m in mutations if m.module in wanted]
    if ids:
        wanted = set(ids.split(","))
        if unknown := wanted - {m.name for m in mutations} - {m.id for m in mutations}:
            raise SystemExit(
                f"error: no mutation {', '.join(sorted(unknown))} (python tools/mutate.py --check lists them)"
            )
        mutations = [m for m in mutations if m.name in wanted or m.id in wanted]
    if not mutations:
        raise SystemExit("error: no mutation selected")
    return mutations


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--modules", help="comma-separated modules to mutate (decoding,images); default: all listed")
    parser.add_argument("--ids", help="comma-separated mutations, as module/id or id")
    parser.add_argument("--list", type=Path, default=LIST, help="the mutations (default tools/mutations.yaml)")
    parser.add_argument("--record", type=Path, default=RECORD, help="the run's record, JSON (and .md beside it)")
    parser.add_argument(
        "--timeout", type=float, default=300, help="seconds a mutation's tests may take (killed after)"
    )
    parser.add_argument("--jobs", type=int, default=1, help="mutations run at the same time (each on its own copy)")
    parser.add_argument("--fresh", action="store_true", help="each run in a new interpreter (slower), not a fork")
    parser.add_argument("--no-baseline", action="store_true", help="skip the unmutated run of the tests")
    parser.add_argument("--keep-output", type=Path, help="a folder for each mutation's pytest output")
    parser.add_argument("--check", action="store_true", help="only check the list: stale entries and unknown tests")
    args = parser.parse_args(argv)
    mutations = select(load(args.list), args.modules, args.ids)
    if args.check:
        bad = [(m, why) for m in mutations if (why := problems(m))]
        for m, why in bad:
            print(f"{m.name}: {why}")
        print(f"{len(mutations) - len(bad)} of {len(mutations)} mutations apply and name existing tests")
        return 1 if bad else 0
    if args.keep_output:
        args.keep_output.mkdir(parents=True, exist_ok=True)
    start, results, fork, failing = time.monotonic(), [], not args.fresh, []

    def report(result: Result) -> None:
        results.append(result)
        print_result(result)

    with tempfile.TemporaryDirectory(prefix="mutate-") as run:
        probe = Path(run, "probe.json")
        if not args.no_baseline or fork:
            said = "their imports (collected only)" if args.no_baseline else "unmutated"
            print(f"baseline: the tests of {len(mutations)} mutation(s), {said}", flush=True)
            code, failing, output = baseline(mutations, args.timeout, probe, collect_only=args.no_baseline)
            if code not in (0, 1):
                raise SystemExit(f"error: the tests do not run unmutated (exit {code}): {output.strip()[-2000:]}")
            if args.no_baseline:
                failing = []
            elif failing:
                print(f"   failing unmutated: {', '.join(failing)}", flush=True)
        template = compiled_copy(Path(run))
        if fork:
            os.environ["HF_DATASETS_CACHE"] = str(Path(run, "hf_datasets"))  # what datasets derives at import
            why = preload(probe) if probe.is_file() else "the baseline listed no libraries"
            if not why and not args.no_baseline:
                why = forks_agree(mutations, template, args.timeout, code, failing)
            if why:
                print(f"   each mutation runs in a new interpreter: {why}", flush=True)
                fork = False
        runnable = []
        for m in mutations:
            if hits := touches(m, failing):
                report(Result(m.name, m.removes, "not run", f"its test fails unmutated: {hits[0]}", tests=m.tests))
            else:
                runnable.append(m)
        run_mutations(runnable, template, args.timeout, max(1, args.jobs), fork, args.keep_output, report)
    order = {m.name: i for i, m in enumerate(mutations)}
    results.sort(key=lambda r: order[r.name])
    command = "python tools/mutate.py " + " ".join(argv if argv is not None else sys.argv[1:])
    write_record(args.record, results, mutations, command.strip(), time.monotonic() - start)
    print()
    for module, counts in summary(results).items():
        print(f"{module}: " + ", ".join(f"{counts[s]} {s}" for s in STATUSES if s in counts))
    print(f"record: {args.record} and {args.record.with_suffix('.md').name}")
    return 1 if any(r.status in ("stale", "invalid", "error") for r in results) else 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:  # a run in a new interpreter (Job.start): --child SRC PROBE PYTEST_ARGS...
        del sys.path[0]  # tools/, which `python -m pytest` would not have
        sys.exit(_pytest(Path(sys.argv[2]), sys.argv[4:], sys.argv[3]))
    sys.exit(main())
