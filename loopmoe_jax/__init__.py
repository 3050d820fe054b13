import os as _os

_PACKAGE = _os.path.dirname(_os.path.abspath(__file__))


def config_file(relative: str) -> str:
  """The absolute path of a file of the repository's configs/ ('configs/foil.py'): the
  checkout's (an editable install, or a run from the repository) or, in an installed wheel,
  the copy setup.py ships as the package's own `loopmoe_jax/configs/`; the relative path
  itself when neither has it."""
  for base in (_os.path.dirname(_PACKAGE), _PACKAGE):
    path = _os.path.join(base, relative)
    if _os.path.exists(path):
      return path
  return relative


# the README's main job, the config the CLIs and benchmarks default to
DEFAULT_CONFIG = config_file(_os.path.join('configs', 'default.py'))
