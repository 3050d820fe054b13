"""DataConfig: the data stream's settings (config section `data`; the pipeline is
data/pipeline.py)."""
from __future__ import annotations

import dataclasses

from loopmoe_jax.config.fields import from_mapping

SOURCES = ('embedded', 'tokens', 'zarr', 'manifest', 'synthetic')
PATH_SOURCES = ('tokens', 'zarr', 'manifest')  # the sources that read data.path / data.val_path


@dataclasses.dataclass(frozen=True)
class DataConfig:
  # embedded | tokens (flat file) | zarr (tensorstore) | manifest (prepare_data.py's sharded
  # DIR: its shards read as one source) | synthetic
  source: str = 'embedded'
  path: str = ''             # token file, zarr path / kvstore JSON spec, or DIR[/manifest.json]
  # validation source of the same kind ('': none, or the embedded split; a manifest source
  # uses the 'val' split of data.path's manifest if it has one); a val_path manifest gives
  # its 'val' split, or its 'train' split when it has no 'val'
  val_path: str = ''
  # 'byte' or a tokenizers JSON file (embedded source; a manifest must have been made with it)
  tokenizer: str = 'byte'
  val_fraction: float = 0.02
  seq_len: int = 128
  batch_size: int = 16       # global batch, split over processes
  seed: int = 0
  val_batches: int = 4
  task: str = 'dyck'         # synthetic task
  num_threads: int = 2
  prefetch: int = 4

  def __post_init__(self):
    if self.source not in SOURCES:
      raise ValueError(f'data.source={self.source!r}: must be one of {SOURCES}')
    for name in ('seq_len', 'batch_size', 'val_batches'):
      if getattr(self, name) < 1:
        raise ValueError(f'data.{name}={getattr(self, name)}: must be >= 1')
    if self.source not in PATH_SOURCES:
      for name in ('path', 'val_path'):
        if getattr(self, name):
          raise ValueError(f'data.{name}={getattr(self, name)!r} is read only by data.source in '
                           f'{PATH_SOURCES}, not data.source={self.source!r}: set '
                           'data.source=tokens (a token file), zarr or manifest, or drop the path')
    if not 0.0 < self.val_fraction < 1.0:
      raise ValueError(f'data.val_fraction={self.val_fraction}: must lie in (0, 1) (the '
                       'embedded corpus needs documents in both splits)')

  @classmethod
  def from_dict(cls, d):
    return from_mapping(cls, d, 'data')
