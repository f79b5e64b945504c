"""Where a run's wall-clock time goes, phase by phase from the process's start (imports included): one line at the
end, and `time_<phase>_s` in all_results.json."""

import logging
import os
import time
from pathlib import Path

import psutil

logger = logging.getLogger(__name__)


def seconds_since_start() -> float:
    """Since this process started, from /proc's start tick (psutil's create_time rounds boot time to seconds)."""
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
        totals = {"total": sum(self.phases.values()), "imports": self.imports}  # imports: within time_startup_s
        return {f"time_{phase}_s": round(seconds, 2) for phase, seconds in (self.phases | totals).items()}

    def log(self) -> None:
        total = sum(self.phases.values()) or 1.0
        parts = " | ".join(f"{p} {s:.1f}s ({s / total:.0%})" for p, s in self.phases.items())
        logger.info("Timeline: %s | total %.1fs (imports before main() %.1fs)", parts, total, self.imports)
