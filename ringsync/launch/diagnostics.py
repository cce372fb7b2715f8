"""What `ringsync run` does so that a job that hangs, crawls or fails can be seen into:
a directory for its ranks' flight records and hang report parts (exported to every
rank), one merged hang report printed as soon as a report's parts are in (a stall, a
SIGUSR1 passed on to the ranks, or the first Ctrl-C, which asks for a report before it
ends the job), and, after a failure, where the ranks diverged (ringsync.diagnose).

Parts written on other hosts stay there (the directory's path is the same on each):
`ringsync report DIR` / `ringsync trace DIR` merge what is copied together.
"""
import os
import shutil
import sys
import tempfile
import threading
import time

from ringsync.diagnose import (count_hang_parts, describe_divergence, format_hang_report,
                               load_flight_records, load_hang_parts)
from ringsync.launch.process import start_thread

POLL_S = 0.2
PATIENCE_S = 3.0  # how long a report waits for its last parts once the first came
INTERRUPT_WAIT_S = 5.0  # the first Ctrl-C: how long the job may take to report


class JobDiagnostics:
    def __init__(self, np: int, environ=None):
        environ = os.environ if environ is None else environ
        self.np = np
        self.own_dir = tempfile.mkdtemp(prefix="ringsync-diag-")
        self.flight_dir = (environ.get("RINGSYNC_FLIGHT_RECORDER_DIR")
                           or os.path.join(self.own_dir, "flight"))
        self.report_dir = (environ.get("RINGSYNC_HANG_REPORT_DIR")
                           or os.path.join(self.own_dir, "hang"))
        self._printed = set()
        self._first_seen = {}
        self._stop = threading.Event()
        self._reported = threading.Event()
        self._interrupted = False
        self._thread = None

    def environment(self) -> dict:
        """What every rank gets (the launcher exports its whole environment)."""
        return {"RINGSYNC_FLIGHT_RECORDER_DIR": self.flight_dir,
                "RINGSYNC_HANG_REPORT_DIR": self.report_dir,
                "RINGSYNC_HANG_REPORT_MERGED_BY": "launcher"}

    def start(self) -> None:
        """Export the directories (the launchers pass this environment on) and watch."""
        self._saved = {name: os.environ.get(name) for name in self.environment()}
        os.environ.update(self.environment())
        self._thread = start_thread(self._watch, name="ringsync-run-reports")

    def stop(self) -> None:
        self._stop.set()
        for name, value in getattr(self, "_saved", {}).items():  # (the launcher's own again)
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(timeout=PATIENCE_S + 1)
        self._print_ready_reports(final=True)

    def first_interrupt(self, ask_report, then_interrupt) -> bool:
        """The first Ctrl-C: ask the ranks for a hang report (ask_report()), and pass the
        interrupt on (then_interrupt()) once it is printed, or after INTERRUPT_WAIT_S.
        False for a later one: the caller passes it on at once."""
        if self._interrupted:
            return False
        self._interrupted = True
        self._reported.clear()
        print("ringsync run: interrupted: asking the ranks for a hang report first "
              "(Ctrl-C again ends the job at once)", file=sys.stderr, flush=True)
        ask_report()

        def later():
            self._reported.wait(INTERRUPT_WAIT_S)
            then_interrupt()
        start_thread(later, name="ringsync-run-interrupt")
        return True

    def _watch(self) -> None:
        while not self._stop.wait(POLL_S):
            self._print_ready_reports()

    def _print_ready_reports(self, final: bool = False) -> None:
        now = time.monotonic()
        for report, parts in sorted(count_hang_parts(self.report_dir).items()):
            if report in self._printed:
                continue
            first = self._first_seen.setdefault(report, now)
            if parts >= self.np or final or now - first >= PATIENCE_S:
                self._printed.add(report)
                self._print_report(report)
                self._reported.set()

    def _print_report(self, report: int) -> None:
        try:
            _, parts = load_hang_parts(self.report_dir, report)
            text = format_hang_report(parts, self.np)
        except Exception as e:  # (the report is a help: it must not end the launcher)
            text = f"ringsync run: hang report {report}: cannot merge its parts ({e})"
        print(f"{text}\nringsync run: parts in {self.report_dir} (`ringsync report "
              f"{self.report_dir} --id {report}`)", file=sys.stderr, flush=True)

    def explain_failure(self) -> None:
        """After a failed job: where the ranks diverged, from the flight records they
        left (nothing when none did)."""
        if not os.path.isdir(self.flight_dir) or not os.listdir(self.flight_dir):
            return
        try:
            text = describe_divergence(load_flight_records(self.flight_dir), self.np)
        except Exception as e:
            text = f"cannot read the flight records ({e})"
        print(f"ringsync run: the ranks' flight records: {text}\nringsync run: records in "
              f"{self.flight_dir} (`ringsync trace {self.flight_dir}`)", file=sys.stderr,
              flush=True)

    def close(self, failed: bool) -> None:
        """Keep what a failure or a report left for the user; remove the rest."""
        if not failed and not self._printed:
            shutil.rmtree(self.own_dir, ignore_errors=True)
