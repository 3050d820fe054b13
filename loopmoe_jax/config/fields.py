"""Building a config section's frozen dataclass from a mapping, one error per bad key."""
from __future__ import annotations

import dataclasses
import difflib
from typing import Any, Callable, Mapping


def from_mapping(cls, d: Mapping[str, Any], where: str,
                 check_key: Callable[[str], None] | None = None):
  """Builds dataclass `cls` from a mapping, rejecting unknown keys with near names;
  `check_key` may refuse a key first (a section's own rule)."""
  d = dict(d.to_dict() if hasattr(d, 'to_dict') else d)
  names = [f.name for f in dataclasses.fields(cls)]
  for key in d:
    if check_key is not None:
      check_key(key)
    if key not in names:
      near = difflib.get_close_matches(key, names, n=3, cutoff=0.5)
      hint = f'; did you mean {", ".join(f"{where}.{n}" for n in near)}?' if near else ''
      raise ValueError(f'unknown config field {where}.{key}{hint}')
  return cls(**d)
