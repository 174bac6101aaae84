"""The ranks agree on each test's outcome (registered by :mod:`.plugin` in a job of several ranks).

After a test's teardown every rank posts ``(outcome, which test)`` to a :class:`Rendezvous` (a
private communicator, so a collective the test left unfinished cannot match it) and waits a
bounded time for the others' records: until the test's limit (``--mpi-timeout``, the
``mpi_timeout`` marker; counted from the test's start) after a pass, ``--mpi-failure-grace``
after anything else. Then:

- every rank came and none failed: nothing changes;
- some rank failed: every rank's report of the test becomes failed, carrying each failing rank's
  traceback and captured output, so rank 0's summary shows them and ``-x`` stops every rank alike;
- some ranks skipped it, the others passed: it is a skip everywhere, naming the ranks;
- ``pytest.exit`` or ``KeyboardInterrupt`` on some rank: every rank's session stops alike;
- some rank did not come in time (stuck, or gone), or left with ``os._exit``: the lowest rank that
  came asks the silent ones where they are (:mod:`.clock`: file, line and stack), its report of
  the test shows it, pytest stops and prints its summary, and the job ends (:mod:`.doom`,
  ``MPI_Abort``, exit 3 for a stuck rank).

Rank 0 writes the terminal report; the other ranks write theirs into a buffer that is printed at
the end only when it holds something rank 0 cannot show (their own collection errors, an internal
error, a report of a stuck test when rank 0 is the stuck one).
"""

from __future__ import annotations

import io
import os
import sys
import time
import warnings
import zlib
from dataclasses import dataclass, field
from typing import Any

import pytest
from _pytest.runner import runtestprotocol  # the protocol without logging (as pytest-rerunfailures does)

from ..comm import failure
from ..comm.rendezvous import Inquiry, Rendezvous
from .clock import FALLBACK, REPORTING, STACK_WAIT, Clock
from .doom import EXIT_FAILED, Ending

#: Exit status when the plugin ends the job (the watchdog's: ranks stopped making progress).
STALL_EXIT = 3
# A non-zero rank prints its buffered report only when it ended otherwise than these.
# (A stop agreed by every rank, pytest.exit's or an interruption's, is said by rank 0 too.)
_SAID_BY_RANK0 = (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED, pytest.ExitCode.NO_TESTS_COLLECTED)
#: Seconds the ranks wait for each other to finish collecting (with a test's limit set; imports
#: of a large project take a while).
COLLECT_WAIT = 300.0


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
    if not reports:  # this rank stopped before it had any
        return
    failed = [r for r in reports if r.failed]
    target = failed[0] if failed else next((r for r in reports if r.when == "call"), reports[-1])
    target.longrepr = MergedRepr(target.longrepr if failed else None, others, rank)
    target.outcome = "failed"


# What a rank says of a test it ran: the codes of its record, and what goes with them.
PASSED, FAILED, SKIPPED, STOPPED, LEFT = 0, 1, 2, 3, 4


@dataclass
class Outcome:
    """One rank's outcome of a test, as the other ranks learn it (pickled when it is not a pass)."""

    code: int
    failures: list[tuple[str, str, str]] = field(default_factory=list)  # failure_text of each failed phase
    text: str = ""  # a skip's reason; pytest.exit's message; what a leaving rank did
    status: int = 0  # pytest.exit's return code (-1: none), os._exit's status
    kind: str = ""  # of a stop: "exit" (pytest.exit) or "interrupt" (KeyboardInterrupt)
    where: tuple[str, int] | None = None  # a skip's file and line


def outcome_of(reports: list[pytest.TestReport]) -> Outcome:
    """This rank's outcome of a test from its reports (an expected failure is not a skip)."""
    failed = [r for r in reports if r.failed]
    if failed:
        return Outcome(FAILED, [failure_text(r) for r in failed])
    skipped = [r for r in reports if r.skipped and not hasattr(r, "wasxfail")]
    if skipped and isinstance(skipped[0].longrepr, tuple):
        path, line, reason = skipped[0].longrepr
        return Outcome(SKIPPED, text=str(reason).removeprefix("Skipped: "), where=(str(path), int(line or 0)))
    return Outcome(SKIPPED) if skipped else Outcome(PASSED)


def stop_of(exc: BaseException) -> Outcome:
    """The outcome of a test that stopped the session on this rank (``pytest.exit``, Ctrl-C)."""
    if isinstance(exc, pytest.exit.Exception):
        status = -1 if exc.returncode is None else int(exc.returncode)
        return Outcome(STOPPED, text=str(exc.msg), status=status, kind="exit")
    return Outcome(STOPPED, text=str(exc), kind="interrupt")


def raise_stop(stop: Outcome, rank: int, nodeid: str) -> None:
    """Stop this rank's session as ``rank``'s stopped: the same exception, naming that rank."""
    if stop.kind == "exit":
        raise pytest.exit.Exception(f"{stop.text} (pytest.exit on rank {rank} in {nodeid})",
                                    None if stop.status < 0 else stop.status)
    raise KeyboardInterrupt(f"on rank {rank} in {nodeid}" + (f": {stop.text}" if stop.text else ""))


def skip_on_every_rank(item: pytest.Item, reports: list[pytest.TestReport], skipped: list[int],
                       first: Outcome) -> None:
    """Some ranks skipped the test, the others passed it: it did not run everywhere, so it is a
    skip on every rank, the reason naming the ranks that skipped."""
    reason = f"Skipped: on rank(s) {skipped} only: {first.text}"
    where = first.where or (str(item.path), item.location[1] + 1)
    own = [r for r in reports if r.skipped]
    target = own[0] if own else next((r for r in reports if r.when == "call"), reports[-1])
    target.outcome = "skipped"
    target.longrepr = (where[0], where[1], reason)


def where_is(rank: int, answer: dict[str, Any] | None, nodeid: str) -> tuple[str, str]:
    """``(one line, stack)`` saying where ``rank`` is, from its answer to "where are you?"."""
    if answer is None:
        line = (f"did not answer within {STACK_WAIT:g} s: stuck in code that holds Python's GIL (mpi4py's "
                "lowercase collectives, comm.allreduce(x) say, wait so; faulthandler writes its stack on its "
                "stderr, 'Timeout' then the stack, most recent call first), or its process is gone")
        return line, line
    if answer["test"] == nodeid:
        line = f"is still in it after {answer['elapsed']:.0f} s, at {answer['where']}"
    elif answer["test"] is None:
        line = f"is between tests, at {answer['where']}"
    else:
        line = f"is in another test, {answer['test']}, at {answer['where']}"
    return line, f"rank {rank} {line}; its stack (most recent call last):\n{answer['stack']}"


def _stack_file(config: pytest.Config) -> Any:
    """Where faulthandler writes a stuck rank's stack: this process's stderr as it is now, before
    pytest captures it (``None`` when pytest's own ``faulthandler_timeout`` uses faulthandler's one timer)."""
    try:
        if float(config.getini("faulthandler_timeout") or 0) > 0:
            return None
    except ValueError:  # -p no:faulthandler: no such ini key, and faulthandler's timer is free
        pass
    try:
        return os.fdopen(os.dup(sys.stderr.fileno()), "w")
    except (OSError, ValueError, AttributeError):  # no real stderr (an embedding): no dump
        return None


def limit_of(item: pytest.Item, default: float) -> float:
    """A test's limit in seconds: its ``mpi_timeout`` marker (checked at collection), else ``default``."""
    marker = item.get_closest_marker("mpi_timeout")
    return float(marker.args[0]) if marker is not None and marker.args else default


class Agreement:
    """The plugin's part for a job of several ranks (see the module docstring)."""

    NAME = "hpctrain-mpi-agreement"

    def __init__(self, config: pytest.Config, meeting: Rendezvous, inquiry: Inquiry, *, timeout: float,
                 grace: float) -> None:
        self.config, self.meeting = config, meeting
        self.rank, self.size = meeting.rank, meeting.size
        self.timeout, self.grace = timeout, grace
        self.current: str | None = None  # the test in progress, for a job ended meanwhile
        self.item: pytest.Item | None = None
        self.stopped = False  # every rank stopped its session alike (pytest.exit, Ctrl-C)
        self.buffer: io.StringIO | None = None
        self.speak = False  # this rank knows something rank 0's report cannot show
        self.exitstatus: int = 0
        self.clock = Clock(inquiry, self._overrun, _stack_file(config))
        self.ending = Ending(self.rank)
        failure.before_abort(self._show_captured)
        failure.before_abort(self.clock.stop)
        self.ending.guard_exit(self._exit_in_test)
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
        return (f"hpctrain: {self.size} ranks agree on each test's outcome (a test's limit {limit}; "
                f"{self.grace:g} s after a failure); rank 0 reports")

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        """Say so when pytest-mpi skips the tests marked ``mpi`` of a job of several ranks."""
        marked = sum(1 for item in items if item.get_closest_marker("mpi") is not None)
        with_mpi = getattr(config.option, "with_mpi", None)
        if marked and with_mpi is False and not getattr(config.option, "only_mpi", False):
            warnings.warn(pytest.PytestWarning(
                f"{self.size} ranks run these tests, but pytest-mpi skips the {marked} test(s) marked mpi "
                f"without --with-mpi: mpiexec -n {self.size} python -m pytest --with-mpi"), stacklevel=1)

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
        self.ending.restore_exit()
        said = self.exitstatus in _SAID_BY_RANK0 or self.stopped or self.ending.doomed is not None
        if self.buffer is not None and (self.speak or not said):
            sys.stdout.write(f"---- rank {self.rank}'s report (rank 0's does not show it) ----\n")
            sys.stdout.write(self.buffer.getvalue())
        sys.stdout.flush()
        sys.stderr.flush()
        if self.ending.doomed is not None:
            self.ending.end_now()  # the reporter at once, the others after it (bounded)
        # No rank leaves before every rank has written its report: under `python -m mpi4py` a
        # failed run ends in MPI_Abort at exit, which would cut rank 0's summary short.
        if self.meeting.usable:
            met = self.meeting.meet((self.exitstatus,), self.grace)
            if met.missing or any(rec[0] for rec in met.records.values()):
                time.sleep(failure.FLUSH_GRACE)  # and the launcher has forwarded it
        self.clock.stop()

    # -- the same tests everywhere -------------------------------------------------------------

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtestloop(self, session: pytest.Session) -> None:
        """Before any test runs: every rank collected the same tests, without errors of its own."""
        ids = [item.nodeid for item in session.items]
        mine = (len(ids), zlib.crc32("\n".join(ids).encode()), session.testsfailed)
        wait = max(self.timeout, COLLECT_WAIT) if self.timeout else None
        met = self.meeting.meet(mine, wait)
        if met.missing:
            self.meeting.end_job(f"hpctrain (pytest): rank(s) {met.missing} did not finish collecting the tests "
                                 f"within {wait:g} s; ending the job (MPI_Abort, exit {STALL_EXIT})", STALL_EXIT)
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
        self.current, self.item = item.nodeid, item
        self.clock.arm(item.nodeid, limit_of(item, self.timeout))
        try:
            reports = runtestprotocol(item, nextitem=nextitem, log=False)
        except (KeyboardInterrupt, pytest.exit.Exception) as exc:  # the session stops: on every rank
            self.clock.disarm()
            self.current = None
            self._agree(item, [], stop_of(exc))
            raise
        self.clock.disarm()
        self.current = None
        self._agree(item, reports, outcome_of(reports))
        for report in reports:
            item.ihook.pytest_runtest_logreport(report=report)
        item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
        return True

    def _agree(self, item: pytest.Item, reports: list[pytest.TestReport], mine: Outcome) -> None:
        """Agree on ``item``'s outcome (bounded waits), then change this rank's reports to it."""
        wait: float | None = self.grace  # after a failure or a stop: a peer may never come
        if mine.code in (PASSED, SKIPPED):  # the peers have until the test's limit (and a second)
            left = self.clock.left()
            wait = None if left is None else left + 1.0
        t0 = time.monotonic()
        met = self.meeting.meet((mine.code, zlib.crc32(item.nodeid.encode())), wait)
        if met.missing:  # (before the deadline: the library reported them lost, under ULFM)
            gone = wait is not None and time.monotonic() - t0 < wait - 0.5
            return self._missing(item, reports, mine, met.missing, wait, gone)
        codes = {r: rec[0] for r, rec in met.records.items()}
        if len({rec[1] for rec in met.records.values()}) == 1 and set(codes.values()) in ({PASSED}, {SKIPPED}):
            return None  # the common cases (passed, or skipped, everywhere): one small message each way
        said = self.meeting.exchange((item.nodeid, mine), self.grace)
        if said.missing:
            return self._missing(item, reports, mine, said.missing, self.grace)
        told: dict[int, Outcome] = {r: o for r, (_, o) in said.records.items()}
        if len({nodeid for nodeid, _ in said.records.values()}) > 1:  # collection agreed: a rank skipped ahead?
            ran = "; ".join(f"rank {r}: {n}" for r, (n, _) in sorted(said.records.items()))
            merge(reports, [(-1, "agreement", "the ranks ran different tests", f"at this point {ran}")], self.rank)
            return None
        return self._settle(item, reports, mine, told)

    def _settle(self, item: pytest.Item, reports: list[pytest.TestReport], mine: Outcome,
                told: dict[int, Outcome]) -> None:
        """Every rank's outcome is here: a rank that left or stopped decides for all, then failures,
        then a skip on some ranks only."""
        left = {r: o.text for r, o in told.items() if o.code == LEFT}
        if left:
            ranks = sorted(left)
            head = (f"{item.nodeid}: rank(s) {ranks} ended their process during it ({'; '.join(left.values())}); "
                    "the other ranks cannot go on without them")
            others = [(r, "call", f"rank {r} ended its process: {text}", text) for r, text in left.items()]
            return self._doom(item, reports, others, head, max(told[r].status for r in ranks) or EXIT_FAILED, ranks)
        stopped = sorted(r for r, o in told.items() if o.code == STOPPED)
        if stopped:
            self.stopped = True
            if mine.code != STOPPED:  # the stopping rank re-raises its own exception
                raise_stop(told[stopped[0]], stopped[0], item.nodeid)
            return None
        others = [(r, *text) for r, o in sorted(told.items()) if r != self.rank for text in o.failures]
        if others:
            return merge(reports, others, self.rank)
        skipped = sorted(r for r, o in told.items() if o.code == SKIPPED)
        if skipped and len(skipped) < self.size:
            skip_on_every_rank(item, reports, skipped, told[skipped[0]])
        return None

    def _missing(self, item: pytest.Item, reports: list[pytest.TestReport], mine: Outcome, missing: list[int],
                 wait: float, gone: bool = False) -> None:
        """Some rank did not finish the test in time: the lowest rank that did asks the silent
        ones where they are and reports it all; the job ends once pytest has said what ran."""
        reporter = min(set(range(self.size)) - set(missing))
        answers = self.clock.ask(missing, (REPORTING, self.rank)) if self.rank == reporter else {}
        others = [(r, "call", *where_is(r, answers.get(r), item.nodeid)) for r in missing]
        if mine.code == FAILED:
            head = (f"{item.nodeid} FAILED on rank {self.rank}, and rank(s) {missing} did not finish it within "
                    f"{wait:g} s (waiting in a collective this rank left?)")
        elif gone:
            head = f"{item.nodeid}: rank(s) {missing} did not finish it: gone (the MPI library reports them lost)"
        else:
            head = (f"{item.nodeid}: rank(s) {missing} did not finish it within its limit of "
                    f"{limit_of(item, self.timeout):g} s")
        places = "; ".join(f"rank {r} {message}" for r, _, message, _ in others if r in answers)
        self._doom(item, reports, others, head + (f" ({places})" if places else ""), STALL_EXIT, missing)

    def _doom(self, item: pytest.Item, reports: list[pytest.TestReport], others: list[tuple[int, str, str, str]],
              head: str, code: int, bad: list[int]) -> None:
        """This test ends the job: its report on the lowest good rank, pytest stops there (its
        summary says what ran), then the job ends (``Ending``)."""
        good = sorted(set(range(self.size)) - set(bad))
        reporter = good[0] if good else 0
        if self.rank == reporter and reports:
            merge(reports, others, self.rank)
            self.speak = self.rank != 0
        items = item.session.items
        after = len(items) - 1 - items.index(item) if item in items else 0
        item.session.shouldstop = (f"rank(s) {bad} did not finish {item.nodeid}: the job ends"
                                   + (f", {after} test(s) after it not run" if after else ""))
        self.ending.doom(head, code, reporter)

    def _exit_in_test(self, code: int, where: str) -> None:
        """``os._exit`` on this rank: inside a test, the other ranks learn it (and rank 0 reports
        it) before the job ends, non-zero; outside one it is left alone."""
        item, self.current = self.item if self.current is not None else None, None
        if item is None:
            return
        self.clock.disarm()
        self._agree(item, [], Outcome(LEFT, text=f"os._exit({code}) at {where} on rank {self.rank}", status=code))
        self.ending.end_now()

    def _overrun(self, test: str, elapsed: float) -> None:
        """The helper thread: this rank is still in ``test`` long past its limit and no rank said
        it reports it (every rank is stuck?). The lowest rank stuck in it reports and ends the job."""
        peers = [r for r in range(self.size) if r != self.rank]
        answers = self.clock.ask(peers)
        stuck = [self.rank] + [r for r, a in answers.items() if a["test"] == test]
        if self.rank != min(stuck):
            self.clock.serve_for(FALLBACK)  # that rank asks this one, then its MPI_Abort ends this process
        mine = self.clock.answer(None)
        lines = [f"hpctrain (pytest): {test} has run {elapsed:.0f} s on rank {self.rank}, past its limit of "
                 f"{self.clock.limit:g} s; no rank finished it to report it; rank(s) {sorted(stuck)} are in it"]
        for r, a in sorted({**answers, self.rank: mine}.items()):
            lines.append(where_is(r, a, test)[1])
        lines += [f"rank {r} {where_is(r, None, test)[0]}" for r in peers if r not in answers]
        reporter = self.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            parts, _ = reporter.build_summary_stats_line()
            lines.append("before it: " + ", ".join(text for text, _ in parts))
        capman = self.config.pluginmanager.get_plugin("capturemanager")
        if capman is not None:  # the report goes to the terminal, not into the test's capture
            capman.suspend(in_=True)
        self.meeting.end_job("\n".join(lines) + f"\nending the job (MPI_Abort, exit {STALL_EXIT}); --mpi-timeout "
                             "or @pytest.mark.mpi_timeout(seconds) set a test's limit", STALL_EXIT)

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
