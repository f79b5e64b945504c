"""A run's figures, drawn by child processes while the GPU evaluates (in-process or in a thread, they cost seconds). They
start with training and import matplotlib then, so that only the drawing is left at the end."""

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
    """Two `python -m vit_recipes.publish.figures` children, each fed one JSON line per figure on its stdin: one draws the
    training plots, the other the confusion matrix (the slowest figure at 100 classes and more), at the same time;
    `finish` waits for them all."""

    def __init__(self):
        package_root = str(Path(__file__).resolve().parents[2])  # importable there however this process found it
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))}
        self._children = {kind: _Child(env) for kind in ("plots", "matrix")}

    def plots(self, history: list[dict], output_dir: str, label_smoothing: float) -> None:
        """`plots.write_plots`, drawn by a child."""
        self._children["plots"].send(
            {"history": history, "output_dir": output_dir, "label_smoothing": label_smoothing}
        )

    def confusion_matrix(self, matrix, label_names: list[str], path: str, title: str = "") -> str:
        """`reports.plot_confusion_matrix`, drawn by a child; the PNG exists once `finish` returns."""
        names = [str(name) for name in label_names]
        message = {"matrix": np.asarray(matrix).tolist(), "label_names": names, "path": path, "title": title}
        self._children["matrix"].send(message)
        return path

    def finish(self) -> None:
        """Wait until every figure is written; a failure is raised here, with the child's last line."""
        for child in self._children.values():  # both told first: they finish their figures at the same time
            child.send({"done": True})
        for child in self._children.values():
            child.wait()


class _Child:
    """One drawing process: its stdin takes the messages, its stderr is kept for the error line."""

    def __init__(self, env: dict):
        self._stderr = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - read in wait(), closed with the object
        self._process = subprocess.Popen(
            [sys.executable, "-m", "vit_recipes.publish.figures"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
            stderr=self._stderr, text=True, env=env,
        )  # fmt: skip

    def send(self, message: dict) -> None:
        # "done" is said, not signalled by closing the pipe: DataLoader workers forked since hold its write end open.
        with contextlib.suppress(BrokenPipeError):  # it had stopped: wait() reports why
            self._process.stdin.write(json.dumps(message) + "\n")
            self._process.stdin.flush()

    def wait(self) -> None:
        with contextlib.suppress(BrokenPipeError):  # it had already stopped: its status and error say why
            self._process.stdin.close()
        if self._process.wait() != 0:
            self._stderr.seek(0)
            lines = self._stderr.read().strip().splitlines() or [f"exit status {self._process.returncode}"]
            raise RuntimeError(f"drawing the run's figures failed: {lines[-1]}")


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
