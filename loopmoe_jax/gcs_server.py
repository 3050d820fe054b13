"""A local GCS-protocol server for tests and benchmarks: gcp-storage-emulator on 127.0.0.1,
in memory, with one bucket, reached through the standard variables (STORAGE_EMULATOR_HOST for
gcsfs and google-cloud-storage, TENSORSTORE_GCS_HTTP_URL for tensorstore), set in this
process while the context is open and returned for child processes.

    with local_gcs('loopmoe-test') as env:
      subprocess.run([... 'scripts/train.py', '--workdir=gs://loopmoe-test/run'], env={**os.environ, **env})
"""
from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time

INSTALL = 'pip install gcp-storage-emulator gcsfs google-cloud-storage'


def executable() -> str | None:
  """The emulator's command (beside this Python, or on PATH), or None."""
  return shutil.which('gcp-storage-emulator', path=os.pathsep.join(
      [os.path.dirname(sys.executable), os.environ.get('PATH', '')]))


@contextlib.contextmanager
def local_gcs(bucket: str):
  exe = executable()
  if exe is None:
    raise FileNotFoundError(f'no gcp-storage-emulator: {INSTALL}')
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    port = s.getsockname()[1]
  proc = subprocess.Popen([exe, 'start', '--host=127.0.0.1', f'--port={port}', '--in-memory',
                           f'--default-bucket={bucket}'],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  deadline = time.time() + 30
  while time.time() < deadline:
    try:
      socket.create_connection(('127.0.0.1', port), timeout=1).close()
      break
    except OSError:
      time.sleep(0.2)
  url = f'http://127.0.0.1:{port}'
  env = {'STORAGE_EMULATOR_HOST': url, 'TENSORSTORE_GCS_HTTP_URL': url}
  saved = {k: os.environ.get(k) for k in env}
  os.environ.update(env)
  try:
    yield env
  finally:
    for k, v in saved.items():
      if v is None:
        os.environ.pop(k, None)
      else:
        os.environ[k] = v
    proc.kill()
    proc.wait()
