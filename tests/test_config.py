"""Config validation and accounting against the real model.

- Bad configs raise ValueError naming the offending field (and near names for typos).
- accounting.count(cfg)['params_total'] == the real Flax param count (jax.eval_shape of init)
  for every variant of every config file (discovered by glob) and for extra field combos.
- Foil's published totals, and flattening (E, D, L) -> (aE, D/a, aL) keeps E_real, E_comp, D*L.
- FLOPs per token == 2 * params_active + 4 * context * H * K * executed layers, with
  params_active brute-forced from the real param tree (every executed use of a weight;
  routed expert tensors scaled by k/E; input embedding free, output head counted; norm gains
  are elementwise and carry no matmul FLOPs).
- KV entries per token == k + v elements of a real decode cache per cached token.
- scripts/describe.py --init prints JSON whose params_total equals params_init.
"""
import dataclasses
import functools
import glob
import re
import importlib.util
import json
import math
import os
import subprocess
import sys
from fractions import Fraction

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

from loopmoe_jax import config as config_lib
from loopmoe_jax.accounting import count, init_param_count
from loopmoe_jax.config import (RUN_FIELDS, ModelConfig, RunConfig, flatten, loop_span, middle_span,
                                model_config_dict)
from loopmoe_jax.decode import cache_bytes, init_cache
from loopmoe_jax.model import LoopedMoE
from loopmoe_jax.runtime import Runtime

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG_FILES = sorted(f for f in glob.glob(os.path.join(ROOT, 'configs', '*.py'))
                      if not f.endswith('__init__.py'))


@functools.lru_cache(maxsize=None)
def load_config_file(path):
  name = 'configs_' + os.path.splitext(os.path.basename(path))[0]
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def model_of(path, arg):
  return ModelConfig.from_dict(load_config_file(path).get_config(arg).model)


def _stem(path):
  return os.path.splitext(os.path.basename(path))[0]


VARIANTS = [(path, arg) for path in CONFIG_FILES for arg in load_config_file(path).VARIANTS]
VARIANT_IDS = [f'{_stem(p)}:{a or "(none)"}' for p, a in VARIANTS]
FOIL = os.path.join(ROOT, 'configs', 'foil.py')

# Small configs covering the structural options (default ModelConfig is CPU-sized).
EXTRA = {
    'default': {},
    'inject_concat': dict(injection='concat'),
    'inject_add': dict(injection='add'),
    'shared_experts': dict(num_shared_experts=2, shared_expert_width=24),
    'dense_outside': dict(prelude_experts=0, coda_experts=0),
    'dense_core': dict(core_experts=0, top_k=1),
    'untied': dict(tie_attention=False, num_loops=3),
    'gqa': dict(num_kv_heads=2),
    'mqa_head_dim': dict(num_kv_heads=1, head_dim=8),
    'tie_embeddings': dict(tie_embeddings=True),
    'no_norm_gain': dict(norm_gain=False),
    'unroll_untied_concat': dict(loop_impl='unroll', tie_attention=False, injection='concat'),
    'remat_untied': dict(remat='full', tie_attention=False),
    'no_core': dict(core_layers=0, num_loops=1),
    'exit_gate': dict(exit='gate', exit_threshold=0.5),
    'core_only': dict(prelude_layers=0, coda_layers=0, num_loops=4),
    'everything': dict(tie_attention=False, injection='concat', num_shared_experts=1,
                       num_kv_heads=2, tie_embeddings=True, norm_gain=False, core_experts=6,
                       top_k=3, core_layers=3, num_loops=2),
}


def _mentions(*words):
  """A pytest.raises match pattern requiring every word, in any order."""
  return ''.join(f'(?=[\\s\\S]*{w})' for w in words)


# Validation -------------------------------------------------------------------------------

@pytest.mark.parametrize('segment', ['prelude', 'core', 'coda'])
def test_top_k_above_a_segments_experts(segment):
  experts = dict(prelude_experts=8, core_experts=8, coda_experts=8)
  experts[f'{segment}_experts'] = 3
  with pytest.raises(ValueError, match=_mentions('top_k', f'{segment}_experts')):
    ModelConfig(top_k=4, **experts)
  ModelConfig(top_k=3, **experts)  # top_k == experts is fine
  # A dense segment (0 experts) or an absent one does not constrain top_k.
  experts[f'{segment}_experts'] = 0
  ModelConfig(top_k=4, **experts)
  ModelConfig(top_k=4, **{**experts, f'{segment}_experts': 3, f'{segment}_layers': 0},
              **({'num_loops': 1} if segment == 'core' else {}))


def test_heads_must_divide_d_model():
  with pytest.raises(ValueError, match=_mentions('num_heads', 'd_model')):
    ModelConfig(d_model=64, num_heads=5)
  assert ModelConfig(d_model=60, num_heads=5, head_dim=12).resolved_head_dim == 12
  assert ModelConfig(d_model=64, num_heads=4).resolved_head_dim == 16


@pytest.mark.parametrize('kv', [3, 8])
def test_kv_heads_must_divide_heads(kv):
  with pytest.raises(ValueError, match='num_kv_heads'):
    ModelConfig(num_heads=4, num_kv_heads=kv)
  assert ModelConfig(num_heads=4, num_kv_heads=2).kv_heads == 2
  assert ModelConfig(num_heads=4, num_kv_heads=0).kv_heads == 4


@pytest.mark.parametrize('field,value', [
    ('dispatch', 'fast'), ('residual_scale', 'half'), ('injection', 'mul'), ('remat', 'some'),
    ('loop_impl', 'while'), ('dtype', 'float64'), ('param_dtype', 'int8'),
])
def test_bad_enum_values_name_the_field(field, value):
  section, cls = ('run', RunConfig) if field in RUN_FIELDS else ('model', ModelConfig)
  with pytest.raises(ValueError, match=_mentions(f'{section}.{field}', value)):
    cls(**{field: value})


@pytest.mark.parametrize('fields,name', [
    (dict(core_layers=-1), 'core_layers'), (dict(dispatch_tile=0), 'dispatch_tile'),
    (dict(expert_block_rows=-1), 'expert_block_rows'),
    (dict(top_k=0), 'top_k'), (dict(num_loops=0), 'num_loops'),
    (dict(d_model=64, num_heads=4, head_dim=7), 'head_dim'),
    (dict(injection='add', core_layers=0), 'injection'),
    (dict(prelude_layers=0, core_layers=0, coda_layers=0), 'core_layers'),
])
def test_other_bad_values_name_the_field(fields, name):
  section, cls = ('run', RunConfig) if name in RUN_FIELDS else ('model', ModelConfig)
  with pytest.raises(ValueError, match=f'{section}.{name}'):
    cls(**fields)


@pytest.mark.parametrize('make', [lambda: ModelConfig(remat='full'),
                                  lambda: ModelConfig().replace(remat='full'),
                                  lambda: ModelConfig.from_dict({'remat': 'full'})],
                         ids=['init', 'replace', 'from_dict'])
def test_a_run_setting_on_the_architecture_is_refused_naming_where_it_goes(make):
  """ModelConfig is the architecture alone: a run setting given to it (code written before the
  split) is refused in one line naming the run section and the runtime; the config files'
  `model.remat` is still read into run (experiment.split_run, tested with the run_v1 fixture)."""
  with pytest.raises(ValueError, match=_mentions('model.remat is a run setting', 'run.remat',
                                                 re.escape('Runtime.of(remat=...)'))):
    make()
  assert ModelConfig(num_loops=3).replace(num_loops=4).num_loops == 4


def test_unknown_field_suggests_near_name():
  with pytest.raises(ValueError, match=_mentions('num_head', 'did you mean', 'model.num_heads')):
    ModelConfig.from_dict({'num_head': 4})
  with pytest.raises(ValueError, match=_mentions('core_expert', 'model.core_experts')):
    ModelConfig.from_dict(model_config_dict().to_dict() | {'core_expert': 4})
  with pytest.raises(ValueError, match='num_head'):
    model_config_dict(num_head=4)
  assert ModelConfig.from_dict(model_config_dict(core_experts=6)).core_experts == 6


def test_spans():
  assert middle_span(12, 0.5, 2) == dict(prelude_layers=3, core_layers=6, coda_layers=3,
                                         num_loops=2)
  assert loop_span(12, 0, 12, 3) == dict(prelude_layers=0, core_layers=12, coda_layers=0,
                                         num_loops=3)
  for start, stop in ((3, 13), (-1, 4), (5, 5), (7, 6)):
    with pytest.raises(ValueError, match='span'):
      loop_span(12, start, stop, 2)
  for fraction in (0.0, -0.5, 1.5):
    with pytest.raises(ValueError, match='span'):
      middle_span(12, fraction, 2)
  with pytest.raises(ValueError, match='loops'):
    loop_span(12, 2, 4, 0)


def test_flatten():
  with pytest.raises(ValueError, match=_mentions('flatten', 'factor=3')):
    flatten(8, 8, 2, 3)
  with pytest.raises(ValueError, match='flatten'):
    flatten(8, 8, 2, 0)
  for e, d, l in ((8, 8, 2), (4, 6, 3), (16, 12, 1)):
    for a in range(1, d + 1):
      if d % a:
        continue
      fe, fd, fl = flatten(e, d, l, a)
      assert (fe, fd, fl) == (a * e, d // a, a * l)
      assert fe * fd == e * d and fd * fl == d * l  # E_real and D*L (so k*D*L) kept


@pytest.mark.parametrize('path', CONFIG_FILES, ids=_stem)
def test_config_files_reject_unknown_argument_key(path):
  module = load_config_file(path)
  with pytest.raises(ValueError, match='no_such_key'):
    module.get_config('no_such_key=1')
  assert any('smoke' in v for v in module.VARIANTS), 'every family has a smoke variant'
  assert module.__doc__ and 'python ' in module.__doc__, 'the docstring gives the command'


def test_config_file_bad_arguments():
  foil = load_config_file(FOIL)
  with pytest.raises(ValueError, match=_mentions('shape', '8x3')):
    foil.get_config('shape=8x3')
  with pytest.raises(ValueError, match=_mentions('smok', 'smoke')):  # near name
    foil.get_config('foil1,smok=1')
  with pytest.raises(ValueError, match='foil9'):
    foil.get_config('foil9')
  default = load_config_file(os.path.join(ROOT, 'configs', 'default.py'))
  with pytest.raises(ValueError, match='smok'):
    default.get_config('smok')
  laws = load_config_file(os.path.join(ROOT, 'configs', 'loop_laws.py'))
  with pytest.raises(ValueError, match=_mentions('loops', 'int')):
    laws.get_config('loops=two')
  assert config_lib.parse_arg('a=3,flag', {'a': 1, 'flag': False}) == {'a': 3, 'flag': True}


def _documented_arguments():
  """Every `--config=configs/FILE.py:ARG` written in the config files' docstrings, the README
  and the documents under docs/ (docs/results.md keeps the commands that made its tables)."""
  import re
  docs = sorted(glob.glob(os.path.join(ROOT, 'docs', '*.md')))
  texts = [open(p).read() for p in CONFIG_FILES + [os.path.join(ROOT, 'README.md')] + docs]
  found = set()
  for text in texts:
    found |= set(re.findall(r'configs/(\w+)\.py:([\w=,.]+)', text))
  return sorted(found)


@pytest.mark.parametrize('stem,arg', _documented_arguments())
def test_every_documented_config_argument_parses(stem, arg):
  module = load_config_file(os.path.join(ROOT, 'configs', f'{stem}.py'))
  ModelConfig.from_dict(module.get_config(arg).model)


def test_relative_links_in_the_docs_point_to_files_that_exist():
  """Every relative markdown link `[text](path#anchor)` in the README and docs/*.md names a
  file of the repository (the README's sections moved to docs/ in issue 38)."""
  docs = sorted(glob.glob(os.path.join(ROOT, 'docs', '*.md')))
  assert {'results.md', 'design.md'} <= {os.path.basename(p) for p in docs}
  links = 0
  for path in [os.path.join(ROOT, 'README.md')] + docs:
    for link in re.findall(r'\]\(([^)\s]+)\)', open(path).read()):
      if '://' in link or link.startswith('#'):
        continue
      links += 1
      target = os.path.join(os.path.dirname(path), link.split('#')[0])
      assert os.path.exists(target), (os.path.relpath(path, ROOT), link)
  assert links >= 4


def test_a_bare_word_selects_the_key_whose_choices_hold_it():
  smelt = load_config_file(os.path.join(ROOT, 'configs', 'smelt.py'))
  assert smelt.get_config('200m').model.to_dict() == smelt.get_config('200m,looped').model.to_dict()
  assert smelt.get_config('baseline').model.d_model == 1280
  assert smelt.get_config('smoke,baseline').model.to_dict() == smelt.get_config(
      'size=smoke,variant=baseline').model.to_dict()
  with pytest.raises(ValueError, match=r"size='1b': must be one of \['200m', 'smoke'\]"):
    smelt.get_config('size=1b')
  with pytest.raises(ValueError, match=r"variant='tiny': must be one of"):
    smelt.get_config('tiny')
  assert config_lib.parse_arg('b', {'a': 'x', 'n': 1}, choices={'a': ('x', 'b')}) == {'a': 'b',
                                                                                      'n': 1}
  with pytest.raises(ValueError, match=r"'c': not a flag; a is one of \['b', 'x'\]"):
    config_lib.parse_arg('c', {'a': 'x'}, choices={'a': ('x', 'b')})


# Parameter accounting ---------------------------------------------------------------------

@pytest.mark.parametrize('path,arg', VARIANTS, ids=VARIANT_IDS)
def test_accounting_equals_init_for_every_config_variant(path, arg):
  cfg = model_of(path, arg)
  acc = count(cfg)
  assert acc['params_total'] == init_param_count(cfg)
  assert acc['params_total'] == sum(acc['breakdown'].values())


@pytest.mark.parametrize('name', sorted(EXTRA))
def test_accounting_equals_init_for_extra_combos(name):
  fields = dict(EXTRA[name])
  run = {k: fields.pop(k) for k in RUN_FIELDS if k in fields}  # they change no parameter
  cfg = ModelConfig(**fields)
  assert count(cfg)['params_total'] == init_param_count(cfg, Runtime.of(**run))


def test_foil_published_totals_and_flattening():
  published = {'base': 553.7, 'foil3': 553.7, 'foil2': 553.7, 'foil1': 553.7,
               'base_tied': 520.2, 'protofoil1': 490.8}
  for arg, millions in published.items():
    assert round(count(model_of(FOIL, arg))['params_total'] / 1e6, 1) == millions, arg
  base_cfg = model_of(FOIL, 'base')
  base = count(base_cfg)
  assert (base_cfg.core_experts, base_cfg.core_layers, base_cfg.num_loops) == (8, 8, 2)
  for arg, factor in (('base', 1), ('foil3', 2), ('foil2', 4), ('foil1', 8)):
    for tied in ('', 'proto'):
      name = {'base': 'base_tied'}.get(arg, f'protofoil{arg[-1]}') if tied else arg
      cfg = model_of(FOIL, name)
      acc = count(cfg)
      assert cfg.tie_attention == bool(tied)
      assert (cfg.core_experts, cfg.core_layers, cfg.num_loops) == (8 * factor, 8 // factor,
                                                                    2 * factor), name
      assert acc['E_real'] == base['E_real'] == 64
      assert acc['E_comp'] == base['E_comp'] == 8 * 2 * 2
      assert cfg.core_layers * cfg.num_loops == 16
      assert acc['E_eq'] == factor * base['E_eq']
      assert acc['E_eq'] == cfg.core_experts * cfg.core_layers * cfg.num_loops


def test_other_published_numbers():
  """The numbers the config docstrings promise: default 1.81M params; SMELT's looped twin at
  1.003x FLOPs, 1.001x params and 1.031x KV per token of its baseline."""
  default = count(model_of(os.path.join(ROOT, 'configs', 'default.py'), ''))
  assert round(default['params_total'] / 1e6, 2) == 1.81
  smelt = os.path.join(ROOT, 'configs', 'smelt.py')
  base, twin = (count(model_of(smelt, f'200m,{v}')) for v in ('baseline', 'looped'))
  for key, ratio in (('flops_per_token', 1.003), ('params_total', 1.001),
                     ('kv_per_token', 1.031)):
    assert round(twin[key] / base[key], 3) == ratio, key


# FLOPs: brute force from the real param tree -----------------------------------------------

@functools.lru_cache(maxsize=None)
def abstract_params(cfg):
  tokens = jax.ShapeDtypeStruct((1, 4), jnp.int32)
  shapes = jax.eval_shape(lambda t: LoopedMoE(cfg).init(jax.random.key(0), t), tokens)
  return nn.unbox(shapes['params'])


def brute_force(cfg, params):
  """(params_active, sum over executed attention calls of H*K) from the param tree alone."""
  active, attn_hk = Fraction(0), 0
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    keys = [k.key for k in path]
    size = math.prod(leaf.shape)
    if keys[-1] == 'scale':                  # RMSNorm gains: elementwise only
      continue
    if keys == ['embed']:                    # a lookup; used again as the head when tied
      active += size if cfg.tie_embeddings else 0
      continue
    if keys == ['head']:
      active += size
      continue
    segment = keys[0]
    assert segment in ('prelude', 'core', 'coda'), keys
    uses = cfg.num_loops if segment == 'core' else 1
    calls = uses
    if keys[1].startswith('pass_attn_'):     # per-pass weights: slice l used on pass l only
      assert leaf.shape[0] == cfg.num_loops
      uses, calls = 1, cfg.num_loops
    if 'moe' in keys and 'shared' not in keys and keys[-1] in ('gate', 'up', 'down'):
      experts = leaf.shape[0]                # routed experts: k of E used per token
      active += Fraction(size * cfg.top_k, experts) * uses
    else:
      active += size * uses
    if keys[-1] == 'q':                      # one attention call per executed use
      attn_hk += calls * leaf.shape[-2] * leaf.shape[-1]
  assert active.denominator == 1
  return int(active), attn_hk


def _physical_layers(path, arg):
  try:
    c = model_of(path, arg)
  except Exception:  # a broken variant fails in the accounting test, not at collection
    return 1 << 30
  return c.prelude_layers + c.core_layers + c.coda_layers


# Per config file, its smoke variant with the fewest physical layers (tracing cost).
SMALL_VARIANTS = [min(((p, a) for p, a in VARIANTS if p == path and 'smoke' in a),
                      key=lambda v: _physical_layers(*v), default=None) for path in CONFIG_FILES]
SMALL_VARIANTS = [v for v in SMALL_VARIANTS if v]
# The combos that change what runs per token (the others only move stored weights around).
FLOP_EXTRAS = ('inject_concat', 'shared_experts', 'dense_outside', 'dense_core', 'untied',
               'mqa_head_dim', 'tie_embeddings', 'no_core', 'core_only', 'everything')
FLOP_CASES = ([('file', p, a) for p, a in SMALL_VARIANTS] +
              [('extra', None, name) for name in FLOP_EXTRAS] +
              [('file', FOIL, 'foil1'), ('file', FOIL, 'protofoil2')])
FLOP_IDS = [f'{_stem(p)}:{a}' if kind == 'file' else a for kind, p, a in FLOP_CASES]


@pytest.mark.parametrize('kind,path,arg', FLOP_CASES, ids=FLOP_IDS)
def test_flops_and_active_params_brute_force(kind, path, arg):
  cfg = model_of(path, arg) if kind == 'file' else ModelConfig(**EXTRA[arg])
  active, attn_hk = brute_force(cfg, abstract_params(cfg))
  assert attn_hk == cfg.num_heads * cfg.resolved_head_dim * cfg.executed_layers
  for context in (2048, 333):
    acc = count(cfg, context)
    assert acc['params_active'] == active
    assert acc['flops_per_token'] == 2 * active + 4 * context * attn_hk


# KV cache -----------------------------------------------------------------------------------

@pytest.mark.parametrize('fields', [
    dict(), dict(tie_attention=False, num_loops=3), dict(num_kv_heads=2),
    dict(num_kv_heads=1, head_dim=8, tie_attention=False), dict(core_layers=0, num_loops=1),
], ids=['tied', 'untied', 'gqa', 'mqa_untied', 'no_core'])
def test_kv_per_token_equals_real_cache(fields):
  cfg = ModelConfig(**fields)
  length = 8
  cache = jax.eval_shape(lambda: init_cache(cfg, batch=1, max_len=length))
  entries = 0
  for path, leaf in jax.tree_util.tree_flatten_with_path(cache)[0]:
    if path[-1].key in ('k', 'v'):
      assert length in leaf.shape
      entries += math.prod(leaf.shape)
  assert entries % length == 0
  assert count(cfg)['kv_per_token'] == entries // length
  # cache_bytes (what generate checks against memory) is the real cache's size, and grows by
  # kv_per_token entries per token
  real = init_cache(cfg, batch=1, max_len=length)
  assert cache_bytes(cfg, 1, length) == sum(x.nbytes for x in jax.tree.leaves(real))
  itemsize = next(x.dtype.itemsize for x in jax.tree.leaves(real) if x.ndim >= 4)
  grown = cache_bytes(cfg, 1, 3 * length) - cache_bytes(cfg, 1, length)
  assert grown == 2 * length * count(cfg)['kv_per_token'] * itemsize


# describe.py ---------------------------------------------------------------------------------

def test_describe_init_matches_accounting():
  proc = subprocess.run(
      [sys.executable, 'scripts/describe.py', '--config=configs/foil.py:foil1', '--init'],
      cwd=ROOT, capture_output=True, text=True, timeout=300,
      env={**os.environ, 'JAX_PLATFORMS': 'cpu'})
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = json.loads(proc.stdout)
  assert out['params_total'] == out['params_init']
  assert round(out['params_init'] / 1e6, 1) == 553.7
  assert out['flops_per_token'] == count(model_of(FOIL, 'foil1'))['flops_per_token']


def test_field_listing_gives_every_field_a_value_and_a_meaning():
  """describe.py --fields: every field of every section of the default config, its value in
  that config and a one-line meaning (the dataclass comment, a heading above a block of
  fields not taken for one field's, or the listing's NOTES)."""
  from loopmoe_jax import DEFAULT_CONFIG
  from loopmoe_jax.config import listing
  from loopmoe_jax.experiment import SECTIONS, load_config
  cfg = load_config(DEFAULT_CONFIG)
  rows = {key: (value, meaning) for key, value, meaning in listing.field_rows(cfg)}
  want = [f'{name}.{f.name}' for name, cls in SECTIONS.items()
          for f in dataclasses.fields(cls)]
  assert sorted(rows) == sorted(want)
  empty = [key for key, (_, meaning) in rows.items() if not meaning.strip()]
  assert not empty, f'fields without a meaning (a comment in config/*.py or listing.NOTES): {empty}'
  assert all('\n' not in m and len(m) <= 114 for _, m in rows.values())
  assert rows['model.d_model'][0] == cfg.model.d_model == 128  # the config's value, not 64
  assert rows['train.steps'][0] == 400
  assert 'SwiGLU expert' in rows['model.expert_width'][1]  # from the field's comment
  assert rows['model.exchange_buffer_factor'][1].startswith('0: exchange buffers')
  assert not rows['model.prelude_layers'][1].startswith('Layout')  # a heading, not its meaning
  assert rows['data.val_path'][1].startswith('validation source')  # the comment above it
  proc = subprocess.run([sys.executable, 'scripts/describe.py', '--fields',
                         '--config=configs/foil.py:foil1'], cwd=ROOT, capture_output=True,
                        text=True, timeout=300, env={**os.environ, 'JAX_PLATFORMS': 'cpu'})
  assert proc.returncode == 0, proc.stderr[-2000:]
  lines = proc.stdout.splitlines()
  assert len(lines) == len(want)
  assert re.match(r'model\.d_model +=\s+1024\s+width of the residual stream', lines[1])


def test_readme_generate_line_stays_within_the_trained_context():
  """The README's own generate.py line: prompt bytes + new tokens fit the main job's context
  (it used to print its own past-the-context warning)."""
  import re  # pylint: disable=import-outside-toplevel
  from loopmoe_jax.experiment import build, load_config  # pylint: disable=import-outside-toplevel
  readme = open(os.path.join(ROOT, 'README.md')).read()
  m = re.search(r"generate\.py --workdir=/tmp/loopmoe_default --prompt='([^']*)' --tokens=(\d+)",
                readme)
  assert m, 'the README has no generate.py line for the main job'
  seq_len = build(load_config('configs/default.py')).data.seq_len
  assert len(m.group(1).encode()) + 1 + int(m.group(2)) <= seq_len  # +1: a BOS, if any


def test_configs_are_found_from_anywhere_installed_or_not(tmp_path, monkeypatch):
  """load_config('configs/X.py') from another directory reads the checkout's file; in an
  installed package (no checkout above it) the copy setup.py ships as loopmoe_jax/configs/."""
  import loopmoe_jax
  from loopmoe_jax.experiment import load_config
  monkeypatch.chdir(tmp_path)
  assert load_config('configs/foil.py:foil2').model.num_loops == 8
  site = tmp_path / 'site' / 'loopmoe_jax'
  (site / 'configs').mkdir(parents=True)
  (site / 'configs' / 'default.py').write_text('x = 1\n')
  monkeypatch.setattr(loopmoe_jax, '_PACKAGE', str(site))
  assert loopmoe_jax.config_file(os.path.join('configs', 'default.py')) == str(
      site / 'configs' / 'default.py')
  assert loopmoe_jax.config_file('configs/none.py') == 'configs/none.py'



def test_cited_formula_sheet_is_in_the_repository():
  """Code cites docs/formulas.md (never a file outside the repository), and every section it
  names there exists."""
  import re
  sheet = open(os.path.join(ROOT, 'docs', 'formulas.md')).read()
  headings = set(re.findall(r'^## (.+?)(?: —|$)', sheet, re.M))
  cited = 0
  for folder in ('loopmoe_jax', 'scripts', 'configs'):
    for path in glob.glob(os.path.join(ROOT, folder, '**', '*.py'), recursive=True):
      text = open(path).read()
      assert 'DESIGN.md' not in text, path
      for section in re.findall(r"docs/formulas\.md, '([^']+)'", text):
        cited += 1
        assert any(h.startswith(section) for h in headings), (path, section, headings)
  assert cited >= 2


@pytest.mark.parametrize('size,context', [('smoke', 128), ('200m', 2048)])
def test_smelt_variants_are_matched_or_refused(size, context):
  """Every looped SMELT variant (the published twin, and ablations of loops, span and depth)
  is within 4% of its own baseline on FLOPs, params and KV per token, or is refused naming
  the budget that fails; before, `200m,looped,loops=3` ran at 1.27x the FLOPs."""
  from loopmoe_jax.accounting import count
  from loopmoe_jax.experiment import build, load_config
  from loopmoe_jax.scaling.matching import ratios
  refused = 0
  for extra in ('', ',loops=3', ',span=1.0', ',layers=8', ',layers=8,loops=3',
                ',span=0.25,loops=4'):
    spec = f'configs/smelt.py:{size},looped{extra}'
    try:
      twin = build(load_config(spec)).model
    except ValueError as e:
      assert re.search(r'(flops|params|kv) \d\.\d{3} of the baseline', str(e)), str(e)
      refused += 1
      continue
    base = build(load_config(spec + ',variant=baseline')).model
    assert base.num_loops == 1 and base.executed_layers == (8 if 'layers=8' in extra else 12)
    r, _ = ratios(twin, count(base, context), context)
    assert all(abs(v - 1) <= 0.04 for v in r.values()), (spec, r)
  assert refused <= 1
