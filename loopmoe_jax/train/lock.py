"""One trainer per workdir: an advisory lock on WORKDIR/.lock.

The lock is `fcntl.flock` on the open file, so the operating system releases it when the
holder exits, crashes or is killed: a lock file left behind by a dead trainer is stale and
recognised as such (its holder is printed and the new run takes over). The file names the
holder (pid, host, start time) for the error a second trainer gets. In a multi-host run
process 0 holds it for all processes of that run (they are one owner). flock is per host:
on a network file system shared by hosts, two hosts' trainers are not kept apart.
"""
from __future__ import annotations

import fcntl
import json
import os
import socket
import time


class WorkdirLocked(RuntimeError):
  """Another live trainer holds the workdir."""


class WorkdirLock:
  def __init__(self, workdir: str, owner: bool = True):
    self.path = os.path.join(workdir, '.lock')
    self.owner = owner
    self._fd = None

  def __enter__(self):
    if not self.owner:
      return self
    os.makedirs(os.path.dirname(self.path), exist_ok=True)
    fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      holder = _read(fd)
      os.close(fd)
      raise WorkdirLocked(
          f'{os.path.dirname(self.path)} is in use by another trainer (pid '
          f'{holder.get("pid", "?")} on host {holder.get("host", "?")}, started '
          f'{holder.get("started", "?")}); wait for it to finish or use another workdir') from None
    stale = _read(fd)
    if stale:
      print(f'note: {self.path} was left by pid {stale.get("pid")} on host '
            f'{stale.get("host")}, which no longer holds it (a stale lock); taking it over',
            flush=True)
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps({'pid': os.getpid(), 'host': socket.gethostname(),
                              'started': time.strftime('%Y-%m-%d %H:%M:%S')}).encode(), 0)
    os.fsync(fd)
    self._fd = fd
    return self

  def __exit__(self, *exc):
    if self._fd is None:
      return
    os.ftruncate(self._fd, 0)  # a clean exit leaves no holder behind
    os.close(self._fd)          # closing releases the flock
    self._fd = None


def _read(fd) -> dict:
  try:
    text = os.pread(fd, 4096, 0).decode()
    return json.loads(text) if text.strip() else {}
  except (OSError, ValueError):
    return {}
