"""Echo the node logs of a run (``RUN_DIR/logs/nodeN.log``) to the console, each line with one short prefix
(``[nodeN rankR]``: orchestrator/processes.py ``echo_line``).

Node agents write their torchrun output into the run dir wherever they run; the driver follows the files,
so ``orch launch`` shows the same live output under Ray as under the local launcher.
"""

from __future__ import annotations

import re
import threading
from pathlib import Path
from typing import Optional, TextIO

from orchestrator.processes import echo_line

NODE_LOG = re.compile(r"node(\d+)\.log$")


class LogEcho:
    """Follows ``log_dir/node*.log`` every ``interval_s`` seconds; ``stop()`` writes what is left."""

    def __init__(self, log_dir: Path, echo: Optional[TextIO], interval_s: float = 0.25):
        self.log_dir, self.echo, self.interval_s = log_dir, echo, interval_s
        self._offsets: dict[Path, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="orch-log-echo", daemon=True)

    def start(self) -> "LogEcho":
        """Follow from the logs' current ends (a run dir launched again keeps its earlier logs)."""
        if self.echo is not None:
            self._offsets = {path: path.stat().st_size for path in self.log_dir.glob("node*.log")}
            self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread.is_alive():
            self._stop.set()
            self._thread.join(timeout=5)
            self._drain()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._drain()

    def _drain(self) -> None:
        for path in sorted(self.log_dir.glob("node*.log")):
            match = NODE_LOG.search(path.name)
            if not match:
                continue
            with path.open("rb") as f:
                f.seek(self._offsets.get(path, 0))
                data = f.read()
            complete = data[:data.rfind(b"\n") + 1]
            if not complete:
                continue
            self._offsets[path] = self._offsets.get(path, 0) + len(complete)
            text = complete.decode(errors="replace")
            self.echo.write("".join(echo_line(match.group(1), line) for line in text.splitlines(keepends=True)))
            self.echo.flush()
