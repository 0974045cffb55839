"""What long work is doing, on stderr: exporting, passes, kernel builds, tuning, measuring, checking.

One live display for the process, so steps nest (a kernel build inside an optimization) as rows of it. It
shows only when stderr is a terminal and not `set_quiet(True)` (the CLI's --quiet): scripts, pipes and logs
see nothing, and nothing here ever reaches stdout, where the CLI writes its report and JSON.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

from rich.console import Console
from rich.progress import BarColumn, Progress, ProgressColumn, SpinnerColumn, Task, TextColumn, TimeElapsedColumn
from rich.text import Text

_quiet = False
_lock = threading.Lock()
_live: list[Progress] = []  # the display while any step is open
_open = 0  # how many steps are open


def set_quiet(quiet: bool) -> None:
    """Show no progress (the CLI's --quiet)."""
    global _quiet
    _quiet = quiet


class _Count(ProgressColumn):
    """"3/7" for a step with a known number of parts, nothing for one without."""

    def render(self, task: Task) -> Text:
        return Text("" if task.total is None else f"{int(task.completed)}/{int(task.total)}")


@contextlib.contextmanager
def step(description: str, total: int | None = None) -> Iterator[Callable[[], None]]:
    """A row "description [bar] n/total elapsed" while the block runs; yields `advance` (one part done)."""
    global _open
    with _lock:
        if not _live:
            console = Console(stderr=True)
            bar = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), _Count(),
                           TimeElapsedColumn(), console=console, transient=True, redirect_stdout=False,
                           disable=_quiet or not console.is_terminal)
            bar.start()
            _live.append(bar)
        bar = _live[0]
        task = bar.add_task(f"tkopt: {description}", total=total)
        _open += 1
    try:
        yield lambda: bar.advance(task)
    finally:
        with _lock:
            bar.remove_task(task)
            _open -= 1
            if _open == 0:
                bar.stop()
                _live.clear()
