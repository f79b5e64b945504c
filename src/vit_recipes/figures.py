"""A run's figures, drawn by a child process while the GPU evaluates (in-process or in a thread, they cost seconds). It
starts with training and imports matplotlib then, so that only the drawing is left at the end."""

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from .plots import figure_grid, write_plots
from .reports import plot_confusion_matrix


class FigureProcess:
    """`python -m vit_recipes.figures`, fed one JSON line per figure on its stdin; `finish` waits for them all."""

    def __init__(self):
        self._stderr = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - read in finish(), closed with the object
        package_root = str(Path(__file__).resolve().parents[1])  # importable there however this process found it
        path = os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))
        self._child = subprocess.Popen(
            [sys.executable, "-m", "vit_recipes.figures"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
            stderr=self._stderr, text=True, env={**os.environ, "PYTHONPATH": path},
        )  # fmt: skip

    def plots(self, history: list[dict], output_dir: str, label_smoothing: float) -> None:
        """`plots.write_plots`, drawn by the child."""
        self._send({"history": history, "output_dir": output_dir, "label_smoothing": label_smoothing})

    def confusion_matrix(self, matrix, label_names: list[str], path: str, title: str = "") -> str:
        """`reports.plot_confusion_matrix`, drawn by the child; the PNG exists once `finish` returns."""
        names = [str(name) for name in label_names]
        self._send({"matrix": np.asarray(matrix).tolist(), "label_names": names, "path": path, "title": title})
        return path

    def finish(self) -> None:
        """Wait until every figure is written; a failure is raised here, with the child's last line."""
        # Said, not signalled by closing the pipe: DataLoader workers forked since hold its write end open.
        self._send({"done": True})
        with contextlib.suppress(BrokenPipeError):  # it had already stopped: its status and error say why
            self._child.stdin.close()
        if self._child.wait() != 0:
            self._stderr.seek(0)
            lines = self._stderr.read().strip().splitlines() or [f"exit status {self._child.returncode}"]
            raise RuntimeError(f"drawing the run's figures failed: {lines[-1]}")

    def _send(self, message: dict) -> None:
        with contextlib.suppress(BrokenPipeError):  # the child stopped: finish() reports why
            self._child.stdin.write(json.dumps(message) + "\n")
            self._child.stdin.flush()


def main() -> None:
    figure_grid(1)  # matplotlib imported while the run trains, not when it waits
    for line in sys.stdin:
        message = json.loads(line)
        if "done" in message:
            break
        if "history" in message:
            write_plots(message["history"], message["output_dir"], message["label_smoothing"])
        else:
            matrix = np.asarray(message["matrix"])
            plot_confusion_matrix(matrix, message["label_names"], message["path"], message["title"])


if __name__ == "__main__":
    main()
