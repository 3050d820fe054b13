"""One trainer per workdir: an advisory lock on WORKDIR/.lock.

The lock is `fcntl.flock` on the open file, so the operating system releases it when the
holder exits, crashes or is killed: a lock file left behind by a dead trainer is stale and
recognised as such (its holder is printed and the new run takes over). The file names the
holder (pid, host, start time) for the error a second trainer gets. In a multi-host run
process 0 holds it for all processes of that run (they are one owner). flock is per host:
on a network file system shared by hosts, two hosts' trainers are not kept apart.

On object storage (a gs:// workdir) there is no flock: the lock is a lease object,
WORKDIR/.lock, naming its holder and when the lease runs out (`LEASE_S` after its last
renewal; a thread renews it every `LEASE_S / 4`). A trainer takes it when there is none or
it has run out (a dead holder's: stale, said so), written only if the object is still the
one it read (a generation-matched write; GCS refuses the second of two racing writers) and
read back after a moment, so two trainers that raced both see who won. A lease whose holder
ran on this host and is gone (a killed trainer restarted on the same machine) is stale at once.
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import threading
import time
import uuid

from loopmoe_jax import storage

log = logging.getLogger(__name__)

LEASE_S = 120.0


class WorkdirLocked(RuntimeError):
  """Another live trainer holds the workdir."""


def _holder() -> dict:
  return {'pid': os.getpid(), 'host': socket.gethostname(),
          'started': time.strftime('%Y-%m-%d %H:%M:%S')}


def _locked(path: str, holder: dict) -> WorkdirLocked:
  return WorkdirLocked(
      f'{storage.dirname(path)} is in use by another trainer (pid {holder.get("pid", "?")} on '
      f'host {holder.get("host", "?")}, started {holder.get("started", "?")}); wait for it to '
      'finish or use another workdir')


class WorkdirLock:
  def __init__(self, workdir: str, owner: bool = True, lease_s: float = LEASE_S):
    self.path = storage.join(workdir, '.lock')
    self.owner, self.lease_s = owner, lease_s
    self._fd = self._lease = None

  def __enter__(self):
    if not self.owner:
      return self
    if storage.is_url(self.path):
      self._lease = _Lease(self.path, self.lease_s)
      self._lease.acquire()
      return self
    os.makedirs(os.path.dirname(self.path), exist_ok=True)
    fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      holder = _read(fd)
      os.close(fd)
      raise _locked(self.path, holder) from None
    stale = _read(fd)
    if stale:
      log.warning(f'{self.path} was left by pid {stale.get("pid")} on host '
                  f'{stale.get("host")}, which no longer holds it (a stale lock); taking it over')
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(_holder()).encode(), 0)
    os.fsync(fd)
    self._fd = fd
    return self

  def __exit__(self, *exc):
    if self._lease is not None:
      self._lease.release()
      self._lease = None
    if self._fd is None:
      return
    os.ftruncate(self._fd, 0)  # a clean exit leaves no holder behind
    os.close(self._fd)          # closing releases the flock
    self._fd = None


def _dead_here(holder: dict) -> bool:
  """The holder ran on this host and its process is gone (a killed trainer restarted on the
  same machine need not wait for its lease to run out)."""
  if holder.get('host') != socket.gethostname() or not isinstance(holder.get('pid'), int):
    return False
  try:
    os.kill(holder['pid'], 0)
  except ProcessLookupError:
    return True
  except PermissionError:
    return False
  return False


def _read(fd) -> dict:
  try:
    text = os.pread(fd, 4096, 0).decode()
    return json.loads(text) if text.strip() else {}
  except (OSError, ValueError):
    return {}


class _Lease:
  """The lease object of a workdir on object storage (module docstring), through tensorstore's
  key-value store (conditional writes by generation)."""

  def __init__(self, url: str, lease_s: float):
    self.kv, self.key = storage.kvstore(url)
    self.url, self.lease_s = url, lease_s
    self.token = uuid.uuid4().hex
    self._stop, self._thread, self._generation = threading.Event(), None, None

  def _read(self):
    r = self.kv.read(self.key).result()
    try:
      body = json.loads(r.value) if r.state == 'value' and r.value.strip() else {}
    except ValueError:
      body = {}
    return body, r.stamp.generation

  def _write(self, generation) -> bool:
    body = dict(_holder(), token=self.token, expires=time.time() + self.lease_s)
    written = self._put(json.dumps(body).encode(), generation)
    # an empty generation: the object changed since it was read (another trainer wrote it)
    self._generation = written.generation or self._generation
    return bool(written.generation)

  def _put(self, value, generation):
    """A write (None: a delete) only if the object is still at `generation`; unconditional
    where the server reports generations tensorstore cannot use (some emulators), the
    read-back in `acquire` then telling racing writers apart."""
    try:
      return self.kv.write(self.key, value, if_equal=generation).result()
    except ValueError as e:
      if 'StorageGeneration' not in str(e):
        raise
      return self.kv.write(self.key, value).result()

  def acquire(self):
    body, generation = self._read()
    live = (body.get('token') and body.get('expires', 0) > time.time() and
            not _dead_here(body))
    if live:
      raise _locked(self.url, body)
    if body.get('token'):
      log.warning(f'{self.url} was left by pid {body.get("pid")} on host {body.get("host")}, '
                  'which is gone or whose lease ran out (a stale lock); taking it over')
    if not self._write(generation):
      raise _locked(self.url, self._read()[0])
    time.sleep(min(1.0, self.lease_s / 10))  # a racing trainer's write lands, or not
    body, self._generation = self._read()
    if body.get('token') != self.token:
      raise _locked(self.url, body)
    self._thread = threading.Thread(target=self._renew, daemon=True, name='workdir-lease')
    self._thread.start()

  def _renew(self):
    while not self._stop.wait(self.lease_s / 4):
      body, generation = self._read()
      if body.get('token') != self.token:
        log.warning(f'{self.url}: the lease was taken by pid {body.get("pid")} on host '
                    f'{body.get("host")}')
        return
      self._write(generation)

  def release(self):
    self._stop.set()
    if self._thread is not None:
      self._thread.join()
    body, generation = self._read()
    if body.get('token') == self.token:  # a clean exit leaves no holder behind
      self._put(None, generation)
