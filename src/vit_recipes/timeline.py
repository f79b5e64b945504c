"""Where a run's wall-clock time goes, phase by phase, counted from the process's start (imports included): a
20-step GPU benchmark spends most of its minute outside the training loop. Logged as one line at the end and saved
as `time_<phase>_s` in all_results.json."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import psutil

logger = logging.getLogger(__name__)


def seconds_since_start() -> float:
    """Since this process started: its start tick in /proc against the boot clock. psutil's create_time adds the
    boot time, which /proc gives in whole seconds: up to a second early, more than a fast exit takes."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        return time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):  # not Linux
        return time.time() - psutil.Process().create_time()


class Timeline:
    def __init__(self) -> None:
        self.imports = seconds_since_start()  # interpreter and imports: the part of start-up before main()
        self._last = time.time() - self.imports  # so the imports before main() are counted too
        self.phases: dict[str, float] = {}

    def mark(self, phase: str) -> None:
        """Close `phase`: the time since the previous mark (or since the process started) is charged to it."""
        now = time.time()
        self.phases[phase] = self.phases.get(phase, 0.0) + max(0.0, now - self._last)
        self._last = now

    def metrics(self) -> dict[str, float]:
        out = {f"time_{phase}_s": round(seconds, 2) for phase, seconds in self.phases.items()}
        out["time_total_s"] = round(sum(self.phases.values()), 2)
        out["time_imports_s"] = round(self.imports, 2)  # within time_startup_s
        return out

    def log(self) -> None:
        total = sum(self.phases.values()) or 1.0
        parts = " | ".join(f"{p} {s:.1f}s ({s / total:.0%})" for p, s in self.phases.items())
        logger.info("Timeline: %s | total %.1fs (imports before main() %.1fs)", parts, total, self.imports)
