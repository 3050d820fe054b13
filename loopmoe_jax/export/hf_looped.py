"""Our looped MoE as a Hugging Face model that keeps its loop (format 'hf-looped'), and back.

The export directory holds config.json (model_type 'loopmoe', every architecture field the
forward reads, `num_loops` the trained pass count as the default, an auto_map for AutoConfig
and AutoModelForCausalLM), the modeling source (hf_looped_src/, SOURCE_FILES, plain
PyTorch), model.safetensors (or hub-style shards) with each parameter once under `model.` +
our dotted name ('model.core.body.layer_0.moe.down') in our layouts and dtypes, the trained
router bias as 'model.router_bias.<segment>', the run's tokenizer (tokenizer.json,
tokenizer_config.json) and a model card (README.md). The per-token early exit ('kl', and
'gate' with its trained 'model.exit_gate_w' [D] and 'model.exit_gate_b' [1]) is config.json's
`exit` and `exit_threshold`, applied as our decode applies it, and the KV layout its
`kv_cache`. The section
'loopmoe' of config.json keeps our model config, the step and the run's resolved config, so
an import gives back the run exactly.

A model whose forward the modeling code does not carry is refused (`unsupported`), naming
the config field.
"""
from __future__ import annotations

import json
import os
import shutil

import numpy as np

from loopmoe_jax.config import ModelConfig
from loopmoe_jax.export import safetensors_io
from loopmoe_jax.model import MAX_LOOPS_FACTOR, bias_shapes

ARCHITECTURE = 'LoopMoEForCausalLM'
MODEL_TYPE = 'loopmoe'
SOURCE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'hf_looped_src')
SOURCE_FILES = ('configuration_loopmoe.py', 'modeling_loopmoe.py', 'core_loopmoe.py',
                'layers_loopmoe.py')
PREFIX = 'model.'
BIAS_PREFIX = 'model.router_bias.'
# HF config name -> ModelConfig field, where the value is the same
SAME = {'vocab_size': 'vocab_size', 'hidden_size': 'd_model', 'num_attention_heads': 'num_heads',
        'num_key_value_heads': 'kv_heads', 'head_dim': 'resolved_head_dim',
        'expert_width': 'expert_width', 'num_experts_per_tok': 'top_k',
        'renormalize': 'renormalize', 'router_score': 'router_score',
        'router_bias': 'router_bias', 'max_expert_devices': 'max_expert_devices',
        'expert_devices': 'expert_devices', 'num_shared_experts': 'num_shared_experts',
        'shared_expert_width': 'shared_width', 'prelude_layers': 'prelude_layers',
        'prelude_experts': 'prelude_experts', 'core_layers': 'core_layers',
        'core_experts': 'core_experts', 'trained_loops': 'num_loops',
        'coda_layers': 'coda_layers', 'coda_experts': 'coda_experts',
        'tie_attention': 'tie_attention', 'residual_scale': 'residual_scale',
        'scale_passes': 'scale_passes', 'injection': 'injection',
        'tie_embeddings': 'tie_embeddings', 'norm_gain': 'norm_gain', 'rms_norm_eps': 'norm_eps',
        'rope_theta': 'rope_theta', 'exit': 'exit', 'exit_threshold': 'exit_threshold',
        'kv_cache': 'kv_cache'}


def unsupported(c: ModelConfig) -> list[str]:
  """The features of `c` the exported modeling code does not carry, each naming its field
  (empty: exportable)."""
  out = []
  if c.capacity_factor:
    out.append(f'model.capacity_factor={c.capacity_factor} (expert capacity drops assignments '
               "by the tokens of a call, in our decode's prefill and batched steps too; the "
               'exported modeling code is dropless)')
  return out


def check_exportable(c: ModelConfig):
  bad = unsupported(c)
  if bad:
    raise ValueError('hf-looped cannot carry ' + '; '.join(bad))


def hf_config(c: ModelConfig, max_positions: int, extra: dict) -> dict:
  """config.json: the architecture under HF names, `num_loops` (the default pass count) the
  trained one, `max_loops` the cap, and 'loopmoe' (`extra`: our model config, the step, the
  run's config)."""
  config = {'architectures': [ARCHITECTURE], 'model_type': MODEL_TYPE,
            'auto_map': {'AutoConfig': 'configuration_loopmoe.LoopMoEConfig',
                         'AutoModelForCausalLM': 'modeling_loopmoe.LoopMoEForCausalLM'}}
  config.update({hf: getattr(c, ours) for hf, ours in SAME.items()})
  config.update(num_loops=c.num_loops, max_loops=MAX_LOOPS_FACTOR * c.num_loops,
                exit_gate=c.exit == 'gate',
                max_position_embeddings=max_positions, use_cache=True,
                tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
                pad_token_id=None, dtype=c.param_dtype, loopmoe=extra)
  return config


def to_tensors(params, router_bias=None) -> dict[str, np.ndarray]:
  """{hub name: array}: every parameter once, as it is (dtype and layout), and the router
  bias (the variables' collection, {'bias': {segment: array}})."""
  # a scalar (the exit gate's b) as [1]: safetensors readers and writers differ on 0-d arrays
  t = {PREFIX + n: np.ascontiguousarray(a).reshape(np.shape(a) or (1,))
       for n, a in safetensors_io.flatten(params).items()}
  for seg, b in ((router_bias or {}).get('bias') or {}).items():
    t[BIAS_PREFIX + seg] = np.ascontiguousarray(np.asarray(b))
  return t


def from_hf(config: dict, tensors: dict[str, np.ndarray], where: str):
  """(ModelConfig, params, router bias {'bias': {segment: array}} or None) of an hf-looped
  directory's config and tensors; a config or tensor set that is not one is a ValueError
  naming what."""
  if config.get('model_type') != MODEL_TYPE or ARCHITECTURE not in (config.get('architectures')
                                                                     or []):
    raise ValueError(f'{where}: model_type {config.get("model_type")!r} / architectures '
                     f'{config.get("architectures")!r} is not an hf-looped export '
                     f'({MODEL_TYPE}, {ARCHITECTURE})')
  stored = (config.get('loopmoe') or {}).get('model')
  if stored:
    cfg = ModelConfig.from_dict(stored, where=f'{where}: loopmoe.model')
  else:
    missing = [n for n in SAME if n not in config]
    if missing:
      raise ValueError(f'{where}/config.json: missing fields {missing}')
    cfg = ModelConfig(**{SAME[n]: config[n] for n in SAME if not n.startswith(
        ('num_key', 'head_dim', 'shared_expert', 'trained'))}, num_kv_heads=config[
            'num_key_value_heads'], head_dim=config['head_dim'], num_loops=config[
                'trained_loops'], shared_expert_width=config['shared_expert_width'],
        param_dtype=config.get('dtype') or 'float32')
  for hf, ours in SAME.items():  # config.json edited away from the stored model: refused
    if hf in config and config[hf] != getattr(cfg, ours):
      raise ValueError(f'{where}/config.json: {hf}={config[hf]!r} differs from the model it '
                       f'was exported from ({ours}={getattr(cfg, ours)!r})')
  check_exportable(cfg)
  flat = {n[len(PREFIX):]: a for n, a in tensors.items()
          if n.startswith(PREFIX) and not n.startswith(BIAS_PREFIX)}
  stray = sorted(n for n in tensors if not n.startswith(PREFIX))
  if stray:
    raise ValueError(f'{where}: extra tensors {stray[:8]}')
  expected = safetensors_io.expected_tensors(cfg)
  flat = {n: a.reshape(()) if n in expected and expected[n].shape == () and a.size == 1 else a
          for n, a in flat.items()}  # scalars travel as [1] (to_tensors)
  safetensors_io.check_tensors(flat, expected, where)
  bias = {n[len(BIAS_PREFIX):]: np.asarray(a) for n, a in tensors.items()
          if n.startswith(BIAS_PREFIX)}
  want = bias_shapes(cfg)
  if set(bias) != set(want) or any(tuple(bias[s].shape) != tuple(want[s]) for s in want):
    raise ValueError(f'{where}: router bias tensors {sorted(bias)} (shapes '
                     f'{[tuple(b.shape) for b in bias.values()]}), expected {want}')
  return cfg, safetensors_io.unflatten(flat), ({'bias': bias} if bias else None)


def copy_source(directory: str):
  """The modeling source files into the export directory."""
  for name in SOURCE_FILES:
    shutil.copyfile(os.path.join(SOURCE_DIR, name), os.path.join(directory, name))


def bytes_to_unicode() -> dict[int, str]:
  """The byte-level BPE alphabet (GPT-2's): printable Latin-1 bytes stand for themselves,
  the other bytes for the code points 256, 257, ... in byte order."""
  keep = (list(range(ord('!'), ord('~') + 1)) + list(range(ord('¡'), ord('¬') + 1)) +
          list(range(ord('®'), ord('ÿ') + 1)))
  out, extra = {}, 0
  for b in range(256):
    if b in keep:
      out[b] = chr(b)
    else:
      out[b] = chr(256 + extra)
      extra += 1
  return out


def write_tokenizer(directory: str, spec: str, max_length: int) -> str:
  """tokenizer.json and tokenizer_config.json of the run's tokenizer (`spec`: 'byte' or a
  tokenizers JSON file) for AutoTokenizer; returns the EOS token. The byte tokenizer becomes
  a byte-level BPE without merges whose ids are the byte values (NUL, our document
  separator, is id 0 and the EOS token, and dropped from input text as ours drops it)."""
  from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers
  if spec in ('', 'byte'):
    alphabet = bytes_to_unicode()
    tok = Tokenizer(models.BPE(vocab={ch: b for b, ch in alphabet.items()}, merges=[]))
    tok.normalizer = normalizers.Replace('\0', '')
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    eos = alphabet[0]
    tok.add_special_tokens([AddedToken(eos, special=True, normalized=False)])
    tok.save(os.path.join(directory, 'tokenizer.json'))
  else:
    from loopmoe_jax.data.tokenizers import HFTokenizer
    ours = HFTokenizer(spec)
    shutil.copyfile(spec, os.path.join(directory, 'tokenizer.json'))
    eos = Tokenizer.from_file(spec).id_to_token(ours.eos_id)
  with open(os.path.join(directory, 'tokenizer_config.json'), 'w') as f:
    json.dump({'tokenizer_class': 'PreTrainedTokenizerFast', 'eos_token': eos,
               'model_max_length': max_length, 'clean_up_tokenization_spaces': False}, f,
              indent=1)
  return eos
