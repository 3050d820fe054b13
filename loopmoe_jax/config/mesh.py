"""MeshConfig: the device mesh's axis sizes (config section `mesh`; meshes are made by
sharding.py)."""
from __future__ import annotations

import dataclasses
import math

from loopmoe_jax.config.fields import from_mapping

AXES = ('dcn_data', 'data', 'fsdp', 'expert', 'tensor')


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """Mesh axis sizes (config key `mesh`); one of data/fsdp/expert/tensor may be -1 (the rest
  of the devices). The product must equal the device count."""
  data: int = -1
  fsdp: int = 1
  expert: int = 1
  tensor: int = 1
  dcn_data: int = 1
  zero_data: bool = False  # dense weights and optimizer moments also split over `data`
                           # (ZeRO-3 style: less memory per device, a gather per use)

  def __post_init__(self):
    free = [a for a in ('data', 'fsdp', 'expert', 'tensor') if getattr(self, a) == -1]
    if len(free) > 1:
      raise ValueError(f'mesh: only one axis may be -1, got {", ".join("mesh." + a for a in free)}')
    if not isinstance(self.zero_data, bool):
      raise ValueError(f'mesh.zero_data={self.zero_data!r}: must be true or false')
    for a in AXES:
      v = getattr(self, a)
      if v < 1 and not (v == -1 and a != 'dcn_data'):
        raise ValueError(f'mesh.{a}={v}: must be >= 1 (or -1 for the remaining devices)')

  def sizes(self, num_devices: int) -> dict[str, int]:
    """Axis sizes with the -1 resolved; an error naming the numbers when they do not fit."""
    given = {a: getattr(self, a) for a in AXES}
    fixed = math.prod(v for v in given.values() if v != -1)
    free = [a for a, v in given.items() if v == -1]
    if free:
      if num_devices % fixed:
        raise ValueError(f'mesh: the fixed axes ({_fmt(given)}) multiply to {fixed}, which does '
                         f'not divide the {num_devices} devices; change them so it does')
      given[free[0]] = num_devices // fixed
    elif fixed != num_devices:
      raise ValueError(f'mesh: {_fmt(given)} multiply to {fixed}, but there are {num_devices} '
                       f'devices; make the product {num_devices} (or set one axis to -1)')
    return given

  @classmethod
  def from_dict(cls, d):
    return from_mapping(cls, d, 'mesh')


def _fmt(sizes):
  return ' x '.join(f'mesh.{a}={v}' for a, v in sizes.items() if v != 1) or 'every axis 1'
