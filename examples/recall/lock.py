"""One ``--out`` holds one run: a lock file naming the run that holds it.

Two runs on one folder used to mix their checkpoints (one died with ``FileNotFoundError``, and a
``--resume`` with another seed went on from the other run's losses). :class:`Lock` creates
``OUT/run.lock`` with ``O_EXCL`` (so of two runs starting at once exactly one gets it), holding
``{"pid", "host"}``, and removes it when the run ends, however it ends short of ``SIGKILL``. A lock
left by a killed run does not block the folder forever: when its host is this one and its process is
gone, it is stale and taken over (a line says so). A lock of another host cannot be checked from
here: the error names the file to remove when that run is known to be over.
"""
from __future__ import annotations

import errno
import json
import os
import socket

NAME = "run.lock"


class Busy(Exception):
    """The folder is in use by another live run (the message says which and what to do)."""


def _alive(pid):
    try:
        os.kill(pid, 0)  # no signal sent: only whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists, another user's
    return True


class Lock:
    """``with Lock(folder):`` holds ``folder/run.lock`` for this process; :class:`Busy` if another run does."""

    def __init__(self, folder, stream=None):
        self.path, self.stream, self.held = os.path.join(os.path.abspath(folder), NAME), stream, False
        self.mine = {"pid": os.getpid(), "host": socket.gethostname()}

    def _holder(self):
        try:
            with open(self.path) as f:
                holder = json.load(f)
            return holder if isinstance(holder, dict) else {}
        except (OSError, ValueError):
            return {}  # being written, or garbage: treated as held by an unknown run

    def acquire(self):
        for _ in range(3):  # a stale lock removed by another starter at the same moment: try again
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except OSError as err:
                if err.errno != errno.EEXIST:
                    raise
            else:
                with os.fdopen(fd, "w") as f:
                    json.dump(self.mine, f)
                self.held = True
                return self
            holder = self._holder()
            pid, host = holder.get("pid"), holder.get("host")
            if host == self.mine["host"] and isinstance(pid, int) and not _alive(pid):
                if self.stream is not None:
                    print(f"{self.path}: left by run {pid}, which is gone; taking it over", file=self.stream)
                try:
                    os.remove(self.path)
                except FileNotFoundError:
                    pass
                continue
            who = f"process {pid} on {host}" if pid is not None else "another run"
            raise Busy(f"--out {os.path.dirname(self.path)} is in use by {who} (lock file {self.path}); give "
                       f"another --out, or wait for that run to end" + ("" if host == self.mine["host"] else
                       ", or remove the lock file if that run is known to be over"))
        raise Busy(f"--out {os.path.dirname(self.path)}: could not take {self.path}")

    def release(self):
        if self.held and self._holder() == self.mine:
            os.remove(self.path)
        self.held = False

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()
