"""Where a run's wall-clock time goes, phase by phase, counted from the process's start (imports included): a
20-step GPU benchmark spends most of its minute outside the training loop. Logged as one line at the end and saved
as `time_<phase>_s` in all_results.json."""

from __future__ import annotations

import logging
import time

import psutil

logger = logging.getLogger(__name__)


class Timeline:
    def __init__(self) -> None:
        self._last = psutil.Process().create_time()  # so the imports before main() are counted too
        self.imports = time.time() - self._last  # interpreter and imports: the part of start-up before main()
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
