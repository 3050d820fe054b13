"""What a script's --help shows and what an unknown flag says (cli.run uses both).

- The flags cli.py defines for a script (--config, --debug, the distributed flags, ...) are
  key flags of the script, so its --help lists them beside its own.
- The usage text is the script's docstring as written: a command continued with `\\` at a
  line end is shown on its lines, not joined into one line with a run of spaces.
- An unknown flag names the near flags and, in a script that reads a config file, the config
  fields of that name (`--steps` -> `--config.train.steps`).
"""
from __future__ import annotations

import ast
import dataclasses
import difflib
import re
import sys

CLI_MODULE = 'loopmoe_jax.cli'


def show_cli_flags(flag_values) -> None:
  """Registers the flags defined in cli.py as key flags of the main module (absl's --help
  lists only the main module's)."""
  main = sys.argv[0]
  for flag in flag_values.flags_by_module_dict().get(CLI_MODULE, []):
    flag_values.register_key_flag_for_module(main, flag)


def docstring_as_written(path: str) -> str | None:
  """The module docstring of the Python file `path` with each `\\`-newline kept as written
  (a plain string literal joins such lines); None when it has none or does not parse."""
  try:
    with open(path, encoding='utf-8') as f:
      source = f.read()
    tree = ast.parse(source)
  except (OSError, SyntaxError, ValueError):
    return None
  node = tree.body[0] if tree.body else None
  if not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
          and isinstance(node.value.value, str)):
    return None
  literal = ast.get_source_segment(source, node.value)
  if literal is None:
    return None
  if not literal.lstrip('bBuU')[:1] in 'rR':  # an escaped backslash-newline, not a joined line
    literal = re.sub(r'(?<!\\)((?:\\\\)*)\\\n', lambda m: m.group(1) + '\\\\\n', literal)
  try:
    return ast.literal_eval(literal)
  except (SyntaxError, ValueError):
    return None


def render_usage() -> None:
  """The main module's docstring, as absl's --help prints it, with its line continuations."""
  main = sys.modules.get('__main__')
  path = getattr(main, '__file__', None)
  if main is not None and path and main.__doc__:
    doc = docstring_as_written(path)
    if doc:
      main.__doc__ = doc


def config_fields() -> list[str]:
  """Every config field as SECTION.FIELD."""
  from loopmoe_jax.experiment import SECTIONS  # pylint: disable=import-outside-toplevel
  return [f'{name}.{f.name}' for name, cls in SECTIONS.items() for f in dataclasses.fields(cls)]


def _config_flags(flag_values) -> list[str]:
  """The names of the flags that read a config file (ml_collections' --config, --baseline)."""
  return [name for name in flag_values if type(flag_values[name]).__name__ == '_ConfigFlag']


def unknown_flag_line(name: str, flag_values) -> str:
  """`unknown flag --NAME; did you mean ...?`: the script's near flags and, for each flag
  that reads a config file, the config fields whose leaf is NAME (or near it)."""
  name = name.split('=', 1)[0]
  leaf = name.rsplit('.', 1)[-1]
  hints = [f'--{n}' for n in difflib.get_close_matches(name, list(flag_values), n=3,
                                                        cutoff=0.75)]
  prefixes = _config_flags(flag_values)
  if prefixes:
    fields = config_fields()
    same = [k for k in fields if k == name or k.rsplit('.', 1)[-1] == leaf]
    if not same:
      near = set(difflib.get_close_matches(leaf, [k.rsplit('.', 1)[-1] for k in fields], n=3,
                                           cutoff=0.8))
      same = [k for k in fields if k.rsplit('.', 1)[-1] in near]
    hints += [f'--{p}.{k}' for p in prefixes for k in same[:4]]
  if not hints:
    return f'unknown flag --{name} (see --helpshort)'
  return f'unknown flag --{name}; did you mean {" or ".join(hints)}?'
