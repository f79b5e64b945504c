"""The index of the records, benchmarks/results/README.md: one line per record, newest first, written from the folders.

    python -m benchmarks.index            # (make index) write benchmarks/results/README.md again
    python -m benchmarks.index --check    # exit 1 when it is out of date or a record breaks the scheme (tests run it)

A record is a folder `<date>_<suite>_<gpus>x<card>` (common.record_folder) holding a README.md and at least one
JSON. Its README's first heading is its title; its `**Question:**`, `**Headline:**` (the figure that answers the
question) and `**Commit:**` lines are what the index shows, and its conclusion is written (not the runner's
placeholder). Its PNG figures stay under MAX_PNG_BYTES. A record is *current* when README.md or a page of docs/
links it: a claim there rests on it. Records removed as superseded stay listed, from removed.yaml beside them, with
the commit whose tree still holds them and the record that replaced them.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: the repository root
from benchmarks.common import CONCLUSION_TO_WRITE, RESULTS, ROOT  # noqa: E402

INDEX = RESULTS / "README.md"
REMOVED = RESULTS / "removed.yaml"
NAME = re.compile(r"^(\d{4}-\d{2}-\d{2})_([a-z0-9_]+)_(\d+)x([A-Za-z0-9.]+)$")
FIELDS = ("Question", "Headline", "Commit")
MAX_PNG_BYTES = 60 * 1024


def read_record(folder: Path) -> dict:
    """The index's facts of one record folder, and what breaks the scheme in it (`problems`)."""
    record = {"name": folder.name, "problems": []}
    match = NAME.match(folder.name)
    if match is None:
        record["problems"].append("its name is not <date>_<suite>_<gpus>x<card>")
    else:
        record.update(date=match[1], suite=match[2], machine=f"{match[3]} x {match[4]}")
    readme = folder / "README.md"
    text = readme.read_text() if readme.is_file() else ""
    if not text:
        record["problems"].append("no README.md")
    title = re.search(r"^# (.+)$", text, re.M)
    record["title"] = title[1].strip() if title else folder.name
    for field in FIELDS:
        found = re.search(rf"^\*\*{field}:\*\* *(.+)$", text, re.M)
        record[field.lower()] = found[1].strip() if found else ""
        if not found or "_to write" in found[1]:
            record["problems"].append(f"its README has no **{field}:** line")
    if CONCLUSION_TO_WRITE in text:
        record["problems"].append("its README's conclusion is still to write")
    if not any(folder.rglob("*.json")):
        record["problems"].append("no JSON")
    for png in folder.rglob("*.png"):
        if png.stat().st_size > MAX_PNG_BYTES:
            record["problems"].append(f"{png.relative_to(folder)} is {png.stat().st_size // 1024} KB (at most 60)")
    return record


def cited() -> set[str]:
    """The record folders that README.md or docs/ link (`benchmarks/results/<name>`)."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    found = {name for page in pages for name in re.findall(r"benchmarks/results/([\w.-]+)", page.read_text())}
    return {name for name in found if not (RESULTS / name).is_file()}  # README.md (this index), removed.yaml


def removed() -> list[dict]:
    import yaml

    return yaml.safe_load(REMOVED.read_text()) if REMOVED.is_file() else []


def records() -> list[dict]:
    folders = sorted((p for p in RESULTS.iterdir() if p.is_dir() and not p.name.startswith(".")), key=lambda p: p.name)
    return sorted((read_record(p) for p in folders), key=lambda r: (r.get("date", ""), r["name"]), reverse=True)


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def render(found: list[dict], gone: list[dict], current: set[str]) -> str:
    lines = ["# Benchmark records", "",
             "Written by `python -m benchmarks.index` (`make index`) from the record folders; do not edit by hand. "
             "How to run a suite and how to read a record: [docs/benchmarks.md](../../docs/benchmarks.md). A record "
             "marked **current** is linked from README.md or docs/: a claim there rests on it. Newest first.", "",
             "| date | record | machine | headline | commit | |", "|---|---|---|---|---|---|"]  # fmt: skip
    for r in found:
        mark = "**current**" if r["name"] in current else ""
        lines.append(f"| {r.get('date', '?')} | [{_cell(r['title'])}]({r['name']}/README.md) | "
                     f"{r.get('machine', '?')} | {_cell(r['headline'])} | {_cell(r['commit'].split(' (')[0])} | {mark} |")  # fmt: skip
    if gone:
        lines += ["", "## Removed as superseded", "",
                  "Each is in git at the commit named: `git show <commit>:benchmarks/results/<record>/README.md`.", "",
                  "| date | record | headline | replaced by | commit |", "|---|---|---|---|---|"]  # fmt: skip
        for r in sorted(gone, key=lambda r: (str(r["date"]), r["name"]), reverse=True):
            lines.append(f"| {r['date']} | `{r['name']}` | {_cell(r['headline'])} | "
                         f"[{r['replaced_by']}]({r['replaced_by']}/README.md) | {r['commit']} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def check(found: list[dict], gone: list[dict], current: set[str]) -> list[str]:
    """What is wrong: a record off the scheme, an index out of date, a link to a record that is not there."""
    names = {r["name"] for r in found}
    wrong = [f"{r['name']}: {p}" for r in found for p in r["problems"]]
    wrong += [f"README.md or docs/ link benchmarks/results/{n}, which is no record folder" for n in current - names]
    wrong += [f"removed.yaml: {r['name']} is replaced by {r['replaced_by']}, which is no record folder"
              for r in gone if r["replaced_by"] not in names]  # fmt: skip
    if not INDEX.is_file() or INDEX.read_text() != render(found, gone, current):
        wrong.append(f"{os.path.relpath(INDEX, ROOT)} is out of date: run python -m benchmarks.index")
    return wrong


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 and say what is wrong")
    args = parser.parse_args(argv)
    found, gone, current = records(), removed(), cited()
    if not args.check:
        INDEX.write_text(render(found, gone, current))
    if wrong := check(found, gone, current):
        print("\n".join(f"error: {line}" for line in wrong), file=sys.stderr)
        return 1
    print(f"{os.path.relpath(INDEX, ROOT)}: {len(found)} records, {len(current & {r['name'] for r in found})} current")
    return 0


if __name__ == "__main__":
    sys.exit(main())
