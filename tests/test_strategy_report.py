"""The strategy report on recorded sample records (tests/data/strategy_report: test fixtures, not measurements)."""

import json
import sys

import pytest
from conftest import ROOT
from PIL import Image

sys.path.insert(0, str(ROOT))  # benchmarks/ is a package of the repository, not of the install
from benchmarks import strategy_report  # noqa: E402

CHARTS = ("throughput", "memory", "step_breakdown", "scaling", "mfu")


@pytest.fixture(scope="module")
def report(tmp_path_factory, fixture_records):
    out = tmp_path_factory.mktemp("report") / "STRATEGY_REPORT.md"
    strategy_report.main([str(fixture_records), "--out", str(out)])
    return out


def section(text: str, heading: str) -> str:
    start = text.index(heading)
    end = text.find("\n## ", start + len(heading))
    return text[start : end if end >= 0 else None]


def test_report_table_for_two_gpus(report):
    text = report.read_text()
    assert text.startswith("# Choosing a distributed strategy\n\n> **FIXTURE DATA**")
    assert "22 benchmark runs (18 succeeded)" in text  # the trainer_state.json next to the records is not one
    base = section(text, "## vit-base, 2 GPUs")
    rows = [line for line in base.splitlines() if line.startswith("| ") and "x" in line.split("|")[1]]
    expected = [
        "| single x1 (bf16) | 128 | 1,100 | 1,100 | 116.4 | 2.33 | 1.0% | 33.0% | 18.0 / 19.0 | – | 128 (OOM at 256) "
        "| 100% (vs itself) | 0.0% (est.) | ok |",
        # Communication overhead measured from the (synthetic) traces of the batch-128 runs:
        "| ddp x2 (bf16) | 128 | 2,120 | 1,060 | 120.8 | 2.42 | 1.0% | 31.8% | 18.6 / 19.5 | 1.34 | 128 (OOM at 256) "
        "| 96% (vs 1 GPU) | 11.8% (trace) | ok |",
        "| zero1 x2 (?) | – | 2,000 | 1,000 | – | – | – | – | – / – | – | – | – | – | ok |",  # a record with few keys
        # Best at batch 256, where no 1-GPU run fits: efficiency and overhead come from batch 128, and say so.
        "| zero2 x2 (bf16) | 256 | 2,150 | 1,075 | 238.1 | 4.76 | 1.0% | 32.2% | 29.0 / 30.5 | – | 256 "
        "| 93% (vs 1 GPU, at batch 128) | 6.8% (est., at batch 128) | ok |",
        "| zero3 x2 (bf16) | 128 | 1,850 | 925 | 138.4 | 2.77 | 1.0% | 27.7% | 12.5 / 13.5 | 0.73 | 128 "
        "| 84% (vs 1 GPU) | 41.0% (trace) | ok |",
        "| zero3_offload x2 (bf16) | 128 | 600 | 300 | 426.7 | 8.53 | 1.0% | 9.0% | 5.5 / 6.5 | – | 128 "
        "| 27% (vs 1 GPU) | 72.7% (est.) | ok |",
        "| fsdp2 x2 (bf16) | 128 | 1,900 | 950 | 134.7 | 2.69 | 1.0% | 28.5% | 12.8 / 13.9 | – | 128 "
        "| 86% (vs 1 GPU) | 13.6% (est.) | ok |",
    ]
    assert rows[: len(expected)] == expected


def test_use_this_when_and_breakdown(report):
    text = report.read_text()
    from vit_recipes.plan import strategies

    assert set(strategy_report.USE_WHEN) == {s.name for s in strategies.STRATEGIES}  # advice for every row
    base = section(text, "## vit-base, 2 GPUs")
    for strategy in ("single x1", "ddp x2", "zero1 x2", "zero2 x2", "zero3 x2", "zero3_offload x2", "fsdp2 x2"):
        assert f"- **{strategy} (" in base, strategy
    assert "- **zero2 x2 (bf16)**: use this when DDP fits only with a small batch" in base
    assert "Measured: fastest here (2,150 img/s at batch 256)" in base
    # another batch than the fastest's: the line says both
    assert "Measured: 86% of the fastest's throughput (1,850 img/s at batch 128; the fastest at batch 256)" in base
    assert "Measured: the reference: 1,100 img/s on 1 GPU at batch 128" in base
    assert "5.5 GiB per GPU at batch 128 (the least)" in base  # ZeRO-3 offload, at the batch all share
    assert "### Step-time breakdown (at batch 128/GPU, ms per step)" in base
    assert "| ddp x2 (bf16) | 128 | 1.2 | 80.5 | 14.2 | 24.8 | 120.8 | trace |" in base
    huge = section(text, "## vit-huge, 2 GPUs")
    assert "| ddp x2 (bf16) |" in huge and "failed (oom)" in huge
    assert (
        "| fsdp2 x2 (bf16) | 16 | 2.0 | 198.0 | – | – | 200.0 | no baseline: compute includes communication |" in huge
    )
    assert "## vit-base, 4 GPUs" in text and "| ddp x4 (bf16) | 128 | 4,000 | 1,000 |" in text
    failed = section(text, "## Runs that did not finish")
    assert failed.count("| oom |") == 4


def test_charts_are_written_and_linked(report):
    text = report.read_text()
    folder = report.parent / "STRATEGY_REPORT_files"
    for name in CHARTS:
        assert f"(STRATEGY_REPORT_files/{name}.png)" in text
        with Image.open(folder / f"{name}.png") as image:
            assert image.format == "PNG" and image.width >= 600 and image.height >= 300


def test_missing_and_odd_values_do_not_break_it(tmp_path):
    records = [
        {"strategy": "ddp", "metrics": {}},  # nothing else at all
        {"strategy": "zero3", "gpus": 2, "metrics": {"train_images_per_second": None, "train_mfu": "n/a"}},
        {"strategy": "fsdp2", "gpus": 2, "per_device_batch": 8, "metrics": {"train_images_per_second": float("nan")}},
        {"strategy": "single", "status": "failed", "failure": "timeout", "error": "timed out after 600 s"},
        {"strategy": "ddp", "gpus": 2, "per_device_batch": 8, "metrics": {"train_images_per_second": 10.0}},
        {"name": "not a record"},
    ]
    (tmp_path / "records.json").write_text(json.dumps(records))
    (tmp_path / "broken.json").write_text("{not json")
    out = strategy_report.build_report([tmp_path], tmp_path / "out" / "report.md")
    text = out.read_text()
    assert "5 benchmark runs (1 succeeded)" in text
    assert "timed out after 600 s" in text
    assert "| ddp x2 (?) | 8 | 10 | 5 | 1600.0 |" in text  # step time derived from images/s, batch and GPUs
    with pytest.raises(SystemExit, match="no benchmark records"):
        strategy_report.build_report([tmp_path / "out"], tmp_path / "again.md")


def test_reads_the_benchmark_suites_records(tmp_path):
    """Records exactly as benchmarks/run.py writes them (the benchmark engineer's fixtures) go through."""
    fixtures = ROOT / "tests/data/benchmarks/fixture_records.json"
    if not fixtures.is_file():
        pytest.skip("benchmark fixtures not present")
    out = strategy_report.build_report([fixtures], tmp_path / "report.md")
    records = [r for r in json.loads(fixtures.read_text()) if isinstance(r, dict) and "strategy" in r]
    assert f"{len(records)} benchmark runs" in out.read_text()
