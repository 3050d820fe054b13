"""One path layer for local paths and object-store URLs (gs://, s3://, ...).

Every path the project takes (workdirs, checkpoints, logs, token files, manifests, exports,
sweep roots) goes through these functions. Local paths use the OS; URLs use fsspec (gcsfs for
gs://, the library Orbax's etils.epath uses too), byte ranges by ranged reads (`read_range`).
What has no meaning on object storage is replaced: a whole-object write is atomic (no
temporary-and-rename), an append rewrites the object, free space is unknown (None), the
one-trainer lock is a lease object (train/lock.py).

A local GCS-protocol server (an emulator) is used when the standard variables point at it,
with anonymous credentials: STORAGE_EMULATOR_HOST=http://127.0.0.1:PORT (gcsfs,
google-cloud-storage) and TENSORSTORE_GCS_HTTP_URL=http://127.0.0.1:PORT (tensorstore, which
Orbax writes the arrays with).
"""
from __future__ import annotations

import functools
import logging
import os
import re
import shutil
import uuid

_PACKAGES = {'gs': 'gcsfs', 'gcs': 'gcsfs', 's3': 's3fs', 'az': 'adlfs', 'abfs': 'adlfs',
             'hf': 'huggingface_hub'}


def is_url(path) -> bool:
  return '://' in str(path)


def _fs(url: str):
  """(fsspec filesystem, path inside it) of a URL; a scheme without its library names the
  pip package; gcsfs's listing cache off (Orbax and tensorstore write the same buckets)."""
  scheme = url.split('://', 1)[0]
  try:
    import fsspec  # pylint: disable=import-outside-toplevel
    options = {}
    if scheme in ('gs', 'gcs'):
      options['use_listings_cache'] = False
      logging.getLogger('gcsfs').setLevel(logging.ERROR)  # "could not determine bucket type"
    return fsspec.core.url_to_fs(url, **options)
  except ImportError as e:
    package = _PACKAGES.get(scheme, 'fsspec')
    raise ValueError(f'{url}: {scheme}:// paths need the {package} package (pip install '
                     f'{package}; {e})') from None
  except ValueError as e:
    if 'Protocol not known' in str(e):
      raise ValueError(f'{url}: unknown URL scheme {scheme}://') from None
    raise


def absolute(path: str) -> str:
  return path if is_url(path) else os.path.abspath(path)


def join(path: str, *names: str) -> str:
  if is_url(path):
    return '/'.join([path.rstrip('/'), *names])
  return os.path.join(path, *names)


def dirname(path: str) -> str:
  if is_url(path):
    scheme, rest = path.split('://', 1)
    return f'{scheme}://{rest.rstrip("/").rsplit("/", 1)[0]}'
  return os.path.dirname(path)


def exists(path: str) -> bool:
  if not is_url(path):
    return os.path.exists(path)
  fs, p = _fs(path)
  return fs.exists(p)


def isdir(path: str) -> bool:
  if not is_url(path):
    return os.path.isdir(path)
  fs, p = _fs(path)
  return fs.isdir(p)


def makedirs(path: str):
  """A directory (on object storage: nothing to make; prefixes exist with their objects)."""
  if not is_url(path):
    os.makedirs(path, exist_ok=True)


def listdir(path: str) -> list[str]:
  """Names in a directory ([] when there is none)."""
  if not is_url(path):
    return os.listdir(path) if os.path.isdir(path) else []
  fs, p = _fs(path)
  try:
    return sorted({e.rstrip('/').rsplit('/', 1)[-1] for e in fs.ls(p, detail=False)})
  except FileNotFoundError:
    return []


def read_bytes(path: str) -> bytes:
  if not is_url(path):
    with open(path, 'rb') as f:
      return f.read()
  fs, p = _fs(path)
  return fs.cat_file(p)


def read_text(path: str) -> str:
  return read_bytes(path).decode()


def read_range(path: str, start: int, stop: int) -> bytes:
  """Bytes [start, stop) of a file: one ranged read on object storage."""
  if not is_url(path):
    with open(path, 'rb') as f:
      f.seek(start)
      return f.read(stop - start)
  fs, p = _fs(path)
  return fs.cat_file(p, start=start, end=stop)


def size(path: str) -> int:
  if not is_url(path):
    return os.path.getsize(path)
  fs, p = _fs(path)
  return int(fs.size(p))


def write_bytes(path: str, data: bytes):
  """Writes a whole file atomically: a temporary file renamed into place locally; one object
  upload (atomic by itself) on object storage."""
  if not is_url(path):
    tmp = path + '.tmp'
    with open(tmp, 'wb') as f:
      f.write(data)
    os.replace(tmp, path)
    return
  fs, p = _fs(path)
  fs.pipe_file(p, data)


def write_text(path: str, text: str):
  write_bytes(path, text.encode())


def remove(path: str):
  if not is_url(path):
    os.remove(path)
    return
  fs, p = _fs(path)
  fs.rm_file(p)


def rename(src: str, dst: str):
  """Moves a file or directory (on object storage: copy, then delete)."""
  if not is_url(src):
    os.rename(src, dst)
    return
  fs, p = _fs(src)
  fs.mv(p, _fs(dst)[1], recursive=True)


def rmtree(path: str):
  if not is_url(path):
    shutil.rmtree(path, ignore_errors=True)
    return
  fs, p = _fs(path)
  try:
    fs.rm(p, recursive=True)
  except FileNotFoundError:
    pass


def free_bytes(path: str) -> int | None:
  """Free bytes where `path` is (or would be) written; None on object storage (unknown)."""
  if is_url(path):
    return None
  while not os.path.exists(path):
    path = os.path.dirname(path)
  return shutil.disk_usage(path).free


def upload_tree(local: str, url: str):
  """Copies a local directory's files to `url` (object storage), names kept."""
  fs, p = _fs(url)
  for root, _, files in os.walk(local):
    for name in files:
      rel = os.path.relpath(os.path.join(root, name), local).replace(os.sep, '/')
      fs.put_file(os.path.join(root, name), f'{p.rstrip("/")}/{rel}')


def check_reachable(url: str, what: str):
  """One line naming the bucket when it cannot be reached or does not exist."""
  if not is_url(url):
    return
  fs, p = _fs(url)
  bucket = p.split('/', 1)[0]
  if url.startswith('gs://') and not re.fullmatch(r'[a-z0-9][a-z0-9._-]{1,61}[a-z0-9]', bucket):
    raise ValueError(f'{what}={url}: {bucket!r} is not a GCS bucket name (3 to 63 lowercase '
                     'letters, digits, dots, dashes, underscores)')
  try:
    ok = fs.exists(bucket)
  except Exception as e:  # pylint: disable=broad-except  (network, credentials)
    raise ValueError(f'{what}={url}: bucket {bucket!r} cannot be reached '
                     f'({type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ""}); '
                     'check the credentials (GOOGLE_APPLICATION_CREDENTIALS or gcloud auth '
                     'application-default login) or STORAGE_EMULATOR_HOST') from None
  if not ok:
    raise ValueError(f'{what}={url}: bucket {bucket!r} does not exist (or is not visible to '
                     'these credentials)')


def kvstore(url: str):
  """(tensorstore key-value store of the bucket, key of `url` in it) for gs:// and s3://."""
  import tensorstore as ts  # pylint: disable=import-outside-toplevel
  scheme, rest = url.split('://', 1)
  bucket, _, key = rest.partition('/')
  driver = {'gs': 'gcs', 's3': 's3'}.get(scheme)
  if driver is None:
    raise ValueError(f'{url}: no key-value store for {scheme}:// (gs:// and s3:// have one)')
  return ts.KvStore.open({'driver': driver, 'bucket': bucket}).result(), key


@functools.lru_cache(maxsize=16)
def honours_preconditions(url: str) -> bool:
  """Whether the object store of `url` refuses a create-only write of an object that exists
  (GCS does; some local emulators do not). Orbax's OCDBT checkpoint format commits by such
  writes: where they are ignored, checkpoints are written one file per array instead
  (train/checkpoint.py). Probed once per URL with a temporary object."""
  kv, key = kvstore(url)
  probe = f'{key.rstrip("/")}/.precondition-probe-{uuid.uuid4().hex}'.lstrip('/')
  absent = kv.read(probe).result().stamp.generation
  kv.write(probe, b'1', if_equal=absent).result()
  second = kv.write(probe, b'2', if_equal=absent).result()
  kv.write(probe, None).result()
  return not second.generation
