"""Redraw a run's plots from OUTPUT_DIR/trainer_state.json (a run draws them itself unless --plots false).

python tools/redraw_plots.py OUTPUT_DIR
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from vit_recipes.publish.plots import write_plots


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output_dir", type=Path)
    args = parser.parse_args(argv)
    state = args.output_dir / "trainer_state.json"
    if not state.is_file():
        parser.exit(2, f"error: {state} not found: is {args.output_dir} a run's output directory?\n")
    for path in write_plots(json.loads(state.read_text())["log_history"], str(args.output_dir)).values():
        print(path)


if __name__ == "__main__":
    main()
