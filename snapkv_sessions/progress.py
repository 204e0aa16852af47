"""Progress on long work (a bundle's conversion, a model's load, ``replay --verify``, a benchmark, the server's
start-up), shown only where someone is watching: the one rule every command goes through.

:func:`mode` is the rule:

* ``off`` inside :func:`quiet` (a command run with ``--json``; :func:`snapkv_sessions.cli.clean_errors` sets it):
  nothing at all, so the command's stdout is its JSON alone and its stderr carries only errors and warnings;
* ``live`` when stderr is a terminal: a rich display on stderr (a spinner, a bar once the total is known, the
  count and the elapsed time), erased when the work ends; a task's lines are printed above it and stay;
* ``plain`` otherwise (a pipe, a file, a test harness, a server's log): a task's lines alone, one per line on
  stderr, so a log gets the record and no control codes.

Progress never writes to stdout, where the commands print their figures and JSON. The library shows it too (a
model loaded in a terminal shows a spinner; in a notebook or a pipe nothing but the lines); rich is imported only
when a live display is shown.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Literal, TextIO

if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import Progress, TaskID

Mode = Literal["off", "plain", "live"]

_lock = threading.Lock()
_quiet = 0  # how many quiet() blocks are open (a command may call into another that opens its own)
_live: Progress | None = None  # the one live display: rich allows one at a time, so nested tasks join it
_live_tasks = 0


@contextmanager
def quiet(on: bool = True) -> Iterator[None]:
    """No progress from anything run inside (``on=False``: no change), whatever stderr is."""
    global _quiet
    if not on:
        yield
        return
    with _lock:
        _quiet += 1
    try:
        yield
    finally:
        with _lock:
            _quiet -= 1


def is_terminal(stream: TextIO) -> bool:
    """Whether ``stream`` is an interactive terminal that can redraw a line (not ``TERM=dumb``)."""
    try:
        return stream.isatty() and os.environ.get("TERM") != "dumb"
    except (AttributeError, ValueError):  # a stream-like object without isatty, or a closed one
        return False


def mode() -> Mode:
    """The rule: ``off`` inside :func:`quiet`, ``live`` when stderr is a terminal, else ``plain``."""
    if _quiet:
        return "off"
    return "live" if is_terminal(sys.stderr) else "plain"  # stderr now: a harness may have replaced it


class Task:
    """One piece of long work as it is shown. This base shows nothing (the ``off`` mode)."""

    def update(self, description: str | None = None, *, completed: float | None = None,
               total: float | None = None) -> None:
        """Say what is being done, how much of it is (``completed``) and of how much (``total``: the spinner
        becomes a bar)."""

    def advance(self, amount: float = 1) -> None:
        """``amount`` more of the work done."""

    def log(self, line: str) -> None:
        """A line that stays (above a live display; on its own line in ``plain`` mode)."""

    def step(self, line: str) -> None:
        """One unit of the work done, saying which: the bar one further, then its line (which redraws the bar)."""
        self.advance()
        self.log(line)


class _Plain(Task):
    def log(self, line: str) -> None:
        print(line, file=sys.stderr, flush=True)  # sys.stderr now, not at import: a harness may have replaced it


class _Live(Task):
    def __init__(self, progress: Progress, task_id: TaskID) -> None:
        self._progress, self._id = progress, task_id

    def update(self, description: str | None = None, *, completed: float | None = None,
               total: float | None = None) -> None:
        self._progress.update(self._id, description=description, completed=completed, total=total)

    def advance(self, amount: float = 1) -> None:
        self._progress.advance(self._id, amount)

    def log(self, line: str) -> None:
        from rich.text import Text

        self._progress.refresh()  # the display drawn again under the line is as of now, not of the last tick
        self._progress.console.print(Text(line))  # Text: a line's brackets are not rich markup


@contextmanager
def task(description: str, total: float | None = None, *, unit: str = "",
         console: Console | None = None) -> Iterator[Task]:
    """Show ``description`` while the block runs, as :func:`mode` says. ``total``: a bar (else a spinner until
    :meth:`Task.update` gives one); ``unit="bytes"`` counts in kB/MB/GB. ``console``: render live there whatever
    stderr is (a test's buffer); :func:`quiet` still wins. A task opened inside another joins its display."""
    # a task inside a live one joins its display whatever stderr is now (the display may have redirected it)
    chosen = "off" if _quiet else "live" if console is not None or _live is not None else mode()
    if chosen == "off":
        yield Task()
        return
    if chosen == "plain":
        yield _Plain()
        return
    progress = _join(console)
    task_id = progress.add_task(description, total=total, unit=unit)
    progress.refresh()  # drawn at once, not at the next tick: a short task shows too
    try:
        yield _Live(progress, task_id)
    finally:
        progress.remove_task(task_id)
        _leave()


def _join(console: Console | None) -> Progress:
    """The live display, started by the first task that needs it."""
    global _live, _live_tasks
    with _lock:
        if _live is None:
            _live = _display(console)
            _live.start()
        _live_tasks += 1
        return _live


def _leave() -> None:
    """A task ended: the last one out stops the display (``transient``: it is erased, its lines stay)."""
    global _live, _live_tasks
    with _lock:
        _live_tasks -= 1
        if _live_tasks == 0 and _live is not None:
            _live.stop()
            _live = None


def _display(console: Console | None) -> Progress:
    from rich import filesize
    from rich.console import Console
    from rich.progress import BarColumn, Progress, ProgressColumn, SpinnerColumn, TextColumn, TimeElapsedColumn
    from rich.progress import Task as RichTask
    from rich.table import Column
    from rich.text import Text

    class Count(ProgressColumn):
        """``3/8`` or ``1.2/2.5 GB``; nothing until the total is known."""

        def render(self, task: RichTask) -> Text:
            if task.total is None:
                return Text("")
            if task.fields.get("unit") == "bytes":
                return Text(f"{filesize.decimal(int(task.completed))}/{filesize.decimal(int(task.total))}")
            return Text(f"{task.completed:g}/{task.total:g}")

    own = console is None
    if own:  # the rule already found stderr a terminal: rich need not guess again (it reads other variables)
        console = Console(file=sys.stderr, force_terminal=True)
    # stdout is never redirected into the display: it holds the command's own output. Other writes to stderr (a
    # warning) go above the display instead of through it, when it is stderr's own. On a narrow terminal the
    # description gives way (an ellipsis), never the count or the time.
    return Progress(SpinnerColumn(), TextColumn("{task.description}", table_column=Column(no_wrap=True,
                                                                                       overflow="ellipsis")),
                    BarColumn(bar_width=30), Count(table_column=Column(no_wrap=True)), TimeElapsedColumn(),
                    console=console, transient=True, redirect_stdout=False, redirect_stderr=own)
