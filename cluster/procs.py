"""Processes by id, safely: a pid plus its start time (from /proc), so that a pid the kernel
has since reused for someone else's process is never signalled. Linux only, like the rest
of the cluster's process handling.

Reaping: a child that exits stays a zombie until its parent collects its status. A process
ended through `terminate` / `wait_gone` that is a child of this one is collected there;
a long-lived parent holding a `subprocess.Popen` collects it the moment it exits with
`reap_when_done` (a thread waiting on that one pid: it takes no other child's status, as a
SIGCHLD handler calling waitpid(-1) would).

Stopping: a long-running command (`up`, `autoscale`) stops on SIGINT and SIGTERM through
`stop_on_signals`, also when it came in with SIGINT ignored: a background job of a
non-interactive shell (a CI script's `&`) inherits that, and Python keeps it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class ProcessRef:
    pid: int
    start_ticks: int  # /proc/<pid>/stat field 22: when it started, in clock ticks since boot

    @classmethod
    def of(cls, pid: int) -> ProcessRef:
        fields = _stat_fields(pid)
        return cls(pid, int(fields[19]) if fields else -1)

    def alive(self) -> bool:
        fields = _stat_fields(self.pid)
        return fields is not None and fields[0] != "Z" and int(fields[19]) == self.start_ticks

    def signal(self, sig: int) -> None:
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)


def _stat_fields(pid: int) -> list[str] | None:
    """/proc/<pid>/stat from field 3 (state) on; None when there is no such process."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return text[text.rindex(")") + 2:].split()


def session_members(session_id: int) -> list[ProcessRef]:
    """Every live process of one session (a `ray start` head we started in its own session:
    its GCS, raylet, the actors' worker processes and what they started)."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        fields = _stat_fields(int(entry.name))
        if fields is not None and fields[0] != "Z" and int(fields[3]) == session_id:
            members.append(ProcessRef(int(entry.name), int(fields[19])))
    return members


def terminate(refs: Iterable[ProcessRef], grace_s: float) -> list[ProcessRef]:
    """SIGTERM each, SIGKILL whatever is still alive after `grace_s`; returns the ones that
    survived even that (should be none)."""
    refs = [r for r in refs if r.alive()]
    for ref in refs:
        ref.signal(signal.SIGTERM)
    wait_gone(refs, grace_s)
    for ref in refs:
        ref.signal(signal.SIGKILL)
    wait_gone(refs, 5.0)
    return [r for r in refs if r.alive()]


def wait_gone(refs: Iterable[ProcessRef], timeout_s: float) -> bool:
    refs = list(refs)
    deadline = time.monotonic() + timeout_s
    while any(r.alive() for r in refs):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    for ref in refs:
        _reap(ref)
    return True


def reap_when_done(popen: subprocess.Popen[bytes]) -> None:
    """Collect the child's exit status as soon as it exits, however it exits (it may still be
    waited on or polled as before: Popen serialises its waits)."""
    threading.Thread(target=popen.wait, name=f"reap-{popen.pid}", daemon=True).start()


def _reap(ref: ProcessRef) -> None:
    """Collect the status of an ended child of this process (a zombie until then)."""
    fields = _stat_fields(ref.pid)
    if fields is None or fields[0] != "Z" or int(fields[1]) != os.getpid() or int(fields[19]) != ref.start_ticks:
        return
    with contextlib.suppress(ChildProcessError):  # a Popen's own wait got there first
        os.waitpid(ref.pid, os.WNOHANG)


def stop_on_signals() -> None:
    """From now on SIGINT and SIGTERM raise KeyboardInterrupt in the main thread."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.default_int_handler)
