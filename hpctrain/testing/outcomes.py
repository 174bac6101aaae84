"""The ranks agree on each test's outcome (registered by :mod:`.plugin` in a job of several ranks).

After a test's teardown every rank posts ``(failed?, which test)`` to a :class:`Rendezvous` (a
private communicator, so a collective the test left unfinished cannot match it) and waits a
bounded time for the others' records. Then:

- every rank came and none failed: nothing changes;
- some rank failed: every rank's report of the test becomes failed, carrying each failing rank's
  traceback and captured output, so rank 0's summary shows them and ``-x`` stops every rank alike;
- some rank did not come in time: this rank prints the test, the silent ranks and its own report
  on stderr, then ends the job (``MPI_Abort``, exit 3), as the stall watchdog does.

Rank 0 writes the terminal report; the other ranks write theirs into a buffer that is printed at
the end only when it holds something rank 0 cannot show (their own collection errors, an internal
error, an interruption).
"""

from __future__ import annotations

import io
import zlib
from dataclasses import dataclass
from typing import Any

import pytest
from _pytest.runner import runtestprotocol  # the protocol without logging (as pytest-rerunfailures does)

from ..comm import failure
from ..comm.rendezvous import Rendezvous

#: Exit status when the plugin ends the job (the watchdog's: ranks stopped making progress).
STALL_EXIT = 3
# A non-zero rank prints its buffered report only when it ended otherwise than these.
_SAID_BY_RANK0 = (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED, pytest.ExitCode.NO_TESTS_COLLECTED)


@dataclass
class _Crash:
    """Enough of pytest's ``ReprFileLocation`` for the summary line (``FAILED id - message``)."""

    path: str
    lineno: int
    message: str


class MergedRepr:
    """A test's failure as every rank saw it: this rank's own report (if it failed here) followed
    by each other failing rank's, under a ``failed on rank R`` line."""

    def __init__(self, own: Any, others: list[tuple[int, str, str, str]], rank: int) -> None:
        self.own, self.others, self.rank = own, others, rank
        first = getattr(own, "reprcrash", None)
        if first is None and others:
            r, _, message, _ = others[0]
            first = _Crash("", 0, f"[rank {r}] {message}")
        self.reprcrash = first

    def toterminal(self, tw: Any) -> None:
        if self.own is not None:
            self.own.toterminal(tw) if hasattr(self.own, "toterminal") else tw.line(str(self.own))
        else:
            failed = ", ".join(str(r) for r, *_ in self.others)
            tw.line(f"passed on rank {self.rank}; failed on rank(s) {failed}:")
        # The same error on several ranks (a check every rank makes) is shown once, the ranks named.
        # (The first line of the message: the rest may differ by an object's address.)
        mine = _first_line(getattr(self.reprcrash, "message", None)) if self.own is not None else None
        groups: dict[tuple[str, str], list[tuple[int, str]]] = {}
        for r, when, message, text in self.others:
            groups.setdefault((when, _first_line(message)), []).append((r, text))
        for (when, message), ranks in groups.items():
            names = ", ".join(str(r) for r, _ in ranks)
            if message == mine:
                tw.line(f"failed alike on rank(s) {names} ({when}): {message}")
                continue
            tw.sep("-", f"failed on rank(s) {names} ({when})")
            tw.line(ranks[0][1].rstrip("\n"))

    def __str__(self) -> str:
        out = io.StringIO()
        from _pytest._io import TerminalWriter

        self.toterminal(TerminalWriter(out))
        return out.getvalue()


def _first_line(text: str | None) -> str | None:
    return text.splitlines()[0] if text else text


def failure_text(report: pytest.TestReport) -> tuple[str, str, str]:
    """``(phase, one-line message, full text with the captured output)`` of a failed report."""
    crash = getattr(report.longrepr, "reprcrash", None)
    lines = report.longreprtext.strip().splitlines()
    message = crash.message if crash is not None else (lines[-1] if lines else "failed")
    text = report.longreprtext
    for name, content in report.sections:
        text += f"\n{'-' * 20} {name} {'-' * 20}\n{content.rstrip()}"
    return report.when, message, text


def merge(reports: list[pytest.TestReport], others: list[tuple[int, str, str, str]], rank: int) -> None:
    """Make this rank's report of a test failed with the other ranks' failures in it."""
    failed = [r for r in reports if r.failed]
    target = failed[0] if failed else next((r for r in reports if r.when == "call"), reports[-1])
    target.longrepr = MergedRepr(target.longrepr if failed else None, others, rank)
    target.outcome = "failed"


class Agreement:
    """The plugin's part for a job of several ranks (see the module docstring)."""

    NAME = "hpctrain-mpi-agreement"

    def __init__(self, config: pytest.Config, meeting: Rendezvous, *, timeout: float, grace: float) -> None:
        self.config, self.meeting = config, meeting
        self.rank, self.size = meeting.rank, meeting.size
        self.timeout, self.grace = timeout, grace
        self.current: str | None = None  # the test in progress, for a job ended meanwhile
        self.buffer: io.StringIO | None = None
        self.speak = False  # this rank knows something rank 0's report cannot show
        self.exitstatus: int = 0
        failure.before_abort(self._show_captured)
        if self.rank != 0:
            self._quiet(config)

    # -- one report for the job --------------------------------------------------------------

    def _quiet(self, config: pytest.Config) -> None:
        """Write this rank's terminal report into a buffer (printed at the end only if needed)."""
        standard = config.pluginmanager.get_plugin("terminalreporter")
        if standard is None:  # -p no:terminal
            return
        config.pluginmanager.unregister(standard)
        self.buffer = io.StringIO()
        config.pluginmanager.register(pytest.TerminalReporter(config, self.buffer), "terminalreporter")

    def pytest_report_header(self, config: pytest.Config) -> str:
        limit = f"{self.timeout:g} s" if self.timeout else "no limit"
        return (f"hpctrain: {self.size} ranks agree on each test's outcome (wait {limit}; "
                f"{self.grace:g} s after a failure); rank 0 reports")

    @pytest.hookimpl(tryfirst=True)
    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        # pytest-mpi prints ~30 lines of MPI build details at the end of every run: one line
        # unless -v (its own switch is the plugin's private flag; harmless if it goes away).
        mpi_plugin = next((p for p in self.config.pluginmanager.get_plugins()
                           if type(p).__module__ == "pytest_mpi" and hasattr(p, "_is_testing_mpi")), None)
        if self.config.option.verbose < 1 and getattr(mpi_plugin, "_is_testing_mpi", False):
            mpi_plugin._is_testing_mpi = False
            terminalreporter.write_line(f"MPI: {self.size} ranks, {self.meeting.library}")

    def pytest_sessionfinish(self, exitstatus: int) -> None:
        self.exitstatus = int(exitstatus)

    @pytest.hookimpl(trylast=True)
    def pytest_unconfigure(self, config: pytest.Config) -> None:
        import sys
        import time

        if self.buffer is not None and (self.speak or self.exitstatus not in _SAID_BY_RANK0):
            sys.stdout.write(f"---- rank {self.rank}'s report (rank 0's does not show it) ----\n")
            sys.stdout.write(self.buffer.getvalue())
        sys.stdout.flush()
        sys.stderr.flush()
        # No rank leaves before every rank has written its report: under `python -m mpi4py` a
        # failed run ends in MPI_Abort at exit, which would cut rank 0's summary short.
        if self.meeting.usable:
            met = self.meeting.meet((self.exitstatus,), self.grace)
            if met.missing or any(rec[0] for rec in met.records.values()):
                time.sleep(failure.FLUSH_GRACE)  # and the launcher has forwarded it

    # -- the same tests everywhere -------------------------------------------------------------

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtestloop(self, session: pytest.Session) -> None:
        """Before any test runs: every rank collected the same tests, without errors of its own."""
        ids = [item.nodeid for item in session.items]
        mine = (len(ids), zlib.crc32("\n".join(ids).encode()), session.testsfailed)
        met = self.meeting.meet(mine, self.timeout)
        if met.missing:
            self._end(f"rank(s) {met.missing} did not finish collecting the tests within {self.timeout:g} s")
        if len(set(met.records.values())) == 1:
            return  # the same everywhere (collection errors alike: pytest stops each rank alike)
        self.speak = met.records[self.rank] != met.records[0]
        told = ", ".join(f"rank {r}: {n} tests, {errs} collection errors" for r, (n, _, errs, *_)
                         in sorted(met.records.items()))
        raise session.Interrupted(f"the ranks collected different tests ({told}); a rank whose "
                                  f"collection differs from rank 0's prints its own report")

    # -- each test -----------------------------------------------------------------------------

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None) -> bool:
        item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
        self.current = item.nodeid
        reports = runtestprotocol(item, nextitem=nextitem, log=False)
        self.current = None
        self._agree(item, reports)
        for report in reports:
            item.ihook.pytest_runtest_logreport(report=report)
        item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
        return True

    def _agree(self, item: pytest.Item, reports: list[pytest.TestReport]) -> None:
        failed = [r for r in reports if r.failed]
        wait = self.grace if failed else self.timeout
        met = self.meeting.meet((int(bool(failed)), zlib.crc32(item.nodeid.encode())), wait)
        if met.missing:
            self._missing(item, failed, met.missing, wait)
        if len({rec[1] for rec in met.records.values()}) > 1:  # collection agreed: a rank skipped ahead?
            names = self.meeting.allgather(item.nodeid)
            ran = "; ".join(f"rank {r}: {n}" for r, n in enumerate(names))
            merge(reports, [(-1, "agreement", "the ranks ran different tests", f"at this point {ran}")], self.rank)
            return
        if not any(rec[0] for rec in met.records.values()):
            return
        texts = self.meeting.allgather([failure_text(r) for r in failed])
        others = [(r, *t) for r, mine in enumerate(texts) if r != self.rank for t in mine]
        if others:
            merge(reports, others, self.rank)

    def _missing(self, item: pytest.Item, failed: list[pytest.TestReport], missing: list[int], wait: float) -> None:
        """Some rank did not finish the test: say which, with this rank's failure, and end the job."""
        if failed:
            head = (f"{item.nodeid} FAILED on rank {self.rank}, and rank(s) {missing} did not finish it within "
                    f"{wait:g} s (waiting in a collective this rank left?)")
            body = "\n".join(failure_text(r)[2] for r in failed)
        else:
            head = (f"{item.nodeid} passed on rank {self.rank}, but rank(s) {missing} did not finish it "
                    f"within {wait:g} s")
            body = ""
        self._end(head + (f"; this rank's report:\n{body}" if body else ""))

    def _end(self, text: str) -> None:
        self.meeting.end_job(f"hpctrain (pytest): {text}\nending the job (MPI_Abort, exit {STALL_EXIT}); "
                             f"--mpi-failure-grace and --mpi-timeout set these waits", STALL_EXIT)

    def _show_captured(self) -> None:
        """Before the job ends (the watchdog's stall report, an error on one rank, this plugin):
        what pytest captured of the test in progress goes to stderr instead of being lost."""
        capman = self.config.pluginmanager.get_plugin("capturemanager")
        if capman is None or self.current is None:
            return
        capman.suspend(in_=True)
        try:
            out, err = capman.read_global_capture()
        except (AssertionError, ValueError, OSError):  # no global capture (-s), or closed
            return
        if out or err:  # hpctrain's own lines carry their [rank R] already
            own = f"[rank {self.rank}] "
            text = "".join(line.removeprefix(own) for line in (out + err).splitlines(keepends=True))
            failure.write_lines(f"hpctrain (pytest): the job ends during {self.current}; this rank's captured "
                                f"output of it:\n{text}")
