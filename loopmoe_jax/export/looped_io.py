"""The hf-looped export's files beyond the weights (modeling source, tokenizer, model card),
its import back into a run directory (an Orbax checkpoint the scripts read with --workdir),
and its check in transformers (`verify`). The format itself: hf_looped.py."""
from __future__ import annotations

import dataclasses
import json
import os

import numpy as np

from loopmoe_jax.export import hf_looped
from loopmoe_jax.model import MAX_LOOPS_FACTOR

PIP = 'pip install torch==2.13.0 transformers==5.24.0'


def to_hf(cfg, params, router_bias=None, run_config: dict | None = None,
          step: int | None = None, command: str | None = None):
  """(config.json, generation_config.json, tensors) of a model: `params` as numpy, the trained
  `router_bias` collection ({'bias': {segment: array}}) or None, `run_config` the run's
  resolved config (kept for the import). Refuses what the modeling code does not carry."""
  hf_looped.check_exportable(cfg)
  run_config = run_config or {}
  # the trained context (what the harness's hf backend cuts contexts to, as our adapter does);
  # RoPE itself runs at any position
  seq_len = int((run_config.get('data') or {}).get('seq_len', 4096))
  extra = {'model': dataclasses.asdict(cfg), 'step': step, 'config': run_config,
           'command': command}
  config = hf_looped.hf_config(cfg, seq_len, extra)
  generation = {'bos_token_id': None, 'eos_token_id': None, 'pad_token_id': None,
                'do_sample': False}
  return config, generation, hf_looped.to_tensors(params, router_bias)


def write_extras(directory: str, cfg, step: int | None, data_cfg=None, command: str | None = None,
                 tensor_bytes: int = 0) -> dict:
  """The modeling source, the tokenizer of `data_cfg` (the run's data section, when its
  tokenizer loads here) and README.md into the export directory; returns {'tokenizer': its
  spec or None}."""
  from loopmoe_jax.data import pipeline
  hf_looped.copy_source(directory)
  spec = None
  if data_cfg is not None and pipeline.data_tokenizer(data_cfg) is not None:
    spec = pipeline.tokenizer_spec(data_cfg)
    hf_looped.write_tokenizer(directory, spec, data_cfg.seq_len)
  with open(os.path.join(directory, 'README.md'), 'w') as f:
    f.write(model_card(cfg, step, command, spec, tensor_bytes))
  return {'tokenizer': spec}


def model_card(c, step: int | None, command: str | None, tokenizer: str | None,
               tensor_bytes: int) -> str:
  """README.md: what the model is, the command that made it, the trained pass count and how
  to choose another, the tensor names, and the harness command."""
  made = command or 'python scripts/export.py --workdir=RUN --format=hf-looped --out=DIR'
  tok = ('`AutoTokenizer.from_pretrained(DIR, trust_remote_code=True)` loads the tokenizer '
         f'the run trained on ({tokenizer}; trust_remote_code only spares the prompt transformers '
         'shows while reading config.json: the tokenizer is a plain tokenizer.json).'
         if tokenizer else
         'No tokenizer: the run\'s could not be loaded at export; feed token ids.')
  per_pass = '' if c.tie_attention else (
      f' This model has per-pass attention: at most {c.num_loops} passes.')
  return card_text(c, step, made, tok, per_pass, tensor_bytes)


def exit_text(c) -> str:
  """The model card's paragraph on the per-token early exit."""
  rules = {'gate': 'its cumulative exit probability (the trained gate, `model.exit_gate_*`) '
                   'reaches the threshold',
           'kl': 'the KL divergence between its consecutive passes falls below the threshold'}
  if c.exit == 'none':
    return ("**Per-token early exit: none trained** (`config.exit='none'`). "
            "`exit='kl', exit_threshold=1e-3` at load adds the zero-shot exit: a token stops "
            f"looping once {rules['kl']}.")
  return (f'**Per-token early exit: `{c.exit}`**, threshold {c.exit_threshold} (`config.exit`, '
          '`config.exit_threshold`): in `generate` and in any forward given a cache, a token '
          f'stops looping once {rules[c.exit]}, as loopmoe_jax applies it when decoding; a '
          'forward without a cache runs every pass. `early_exit=True` / `False` (forward or '
          "generate) forces it on or off; `exit='none'` at load runs every pass everywhere "
          "(what loopmoe_jax's harness adapter scores: add it to the harness's model_args).")


def card_text(c, step, made, tok, per_pass, tensor_bytes) -> str:
  """The model card's text (`model_card`)."""
  return f"""---
library_name: transformers
tags: [loopmoe, looped-transformer, mixture-of-experts, custom_code]
---
# Looped MoE (loopmoe_jax export, step {step})

A looped Mixture-of-Experts language model: {c.prelude_layers} prelude layer(s)
({c.prelude_experts} experts; 0 = dense), a core of {c.core_layers} layer(s) with
{c.core_experts} experts whose weights are shared and run `num_loops` times, and
{c.coda_layers} coda layer(s) ({c.coda_experts} experts); top-{c.top_k} routing
({c.router_score}, router bias {c.router_bias!r}) recomputed on every pass; d_model
{c.d_model}, {c.num_heads} heads ({c.kv_heads} KV heads) of {c.resolved_head_dim}; vocabulary
{c.vocab_size}. Weights: {tensor_bytes:,} bytes, each shared weight stored once.

Made by: `{made}`

**Trained pass count: {c.num_loops}** (`config.num_loops`, the default). Choose another per
call or at load (1 to {MAX_LOOPS_FACTOR * c.num_loops}, `config.max_loops`).{per_pass}

```python
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True, dtype='float32')
tok = AutoTokenizer.from_pretrained(DIR, trust_remote_code=True)
ids = tok('def ', return_tensors='pt').input_ids
logits = model(ids, num_loops=6).logits              # 6 passes through the core
out = model.generate(ids, max_new_tokens=32, do_sample=False, num_loops=6)
model = AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True, num_loops=6)
```

{tok}

{exit_text(c)}

KV cache while decoding: `config.kv_cache` = '{c.kv_cache}' ('per_pass': one entry per executed
pass and layer, decoding is the full forward exactly; 'last_pass' / 'first_pass': one entry
per core layer holding that pass's K/V, L times smaller), settable at load.

LM Evaluation Harness, `hf` backend (extra model_args reach `from_pretrained`, which sets
config fields, so `num_loops` picks the passes):

```
lm_eval --model hf --model_args pretrained=DIR,trust_remote_code=True,dtype=float32,num_loops=6 --tasks TASK
```

Tensors (`model.safetensors`): `model.` + loopmoe_jax's parameter names in its layouts
(q/k/v [D, heads, K], o [H, K, D], router [D, E], experts gate/up [E, D, F], down [E, F, D],
embed [V, D], head [D, V]; per-pass attention `model.core.pass_attn_<i>.*` [L, ...]), the
trained router bias as `model.router_bias.<segment>`, and a trained exit gate as
`model.exit_gate_w` [D] and `model.exit_gate_b` [1] (loopmoe_jax's scalar b). `config.json`'s
`loopmoe` section keeps the run's config: `python scripts/export.py --import=hf-looped
--src=DIR --out=RUN` gives the run back (its parameters bit-identical).
"""


def write_run(directory: str, run_config: dict, params, router_bias, step: int):
  """A run directory (checkpoints/<step>/ with the params, the router bias and the config)
  that RunDir.load, evaluate.py, generate.py and lm_eval.py read; no optimizer state, so it
  is not a run to resume."""
  import jax.numpy as jnp
  from loopmoe_jax.train import checkpoint
  state = {'params': jax_tree(jnp.asarray, params)}
  if router_bias:
    state['router_bias'] = jax_tree(jnp.asarray, router_bias)
  mngr = checkpoint.manager(os.path.join(directory, 'checkpoints'), keep=1, async_save=False)
  try:
    checkpoint.save(mngr, step, state, {}, json.dumps(run_config))
    mngr.wait_until_finished()
  finally:
    mngr.close()


def jax_tree(fn, tree):
  import jax
  return jax.tree.map(fn, tree)


def import_run(config: dict, tensors: dict, src: str):
  """(run config dict, params, router bias, step) of an hf-looped directory's config and
  tensors: the stored run config when the export kept one, else defaults around the model."""
  cfg, params, bias = hf_looped.from_hf(config, tensors, src)
  stored = config.get('loopmoe') or {}
  run_config = stored.get('config')
  if not run_config:
    from loopmoe_jax.config import model_config_dict
    from loopmoe_jax.experiment import experiment_config
    run_config = experiment_config(model_config_dict(**dataclasses.asdict(cfg))).to_dict()
  return run_config, params, bias, int(stored.get('step') or 0)


def packages():
  """(torch, transformers), or an ImportError naming the pip command."""
  try:
    import torch  # pylint: disable=import-outside-toplevel
    import transformers  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise ImportError(f'loading an hf-looped export needs torch and transformers ({e}); '
                      f'{PIP}') from None
  return torch, transformers


def pass_counts(c) -> list[int]:
  """The pass counts --verify compares: 1, the trained count and twice it (per-pass attention:
  1, one less and the trained count)."""
  l = c.num_loops
  return sorted({1, l, 2 * l} if c.tie_attention else {1, max(1, l - 1), l})


def verify(run, out: str, tokens: int = 256, greedy: int = 16) -> dict:
  """The export loaded with AutoModelForCausalLM (trust_remote_code, float32, CPU) against our
  model on the run's first validation window(s): the max absolute logit difference at each
  of `pass_counts` (with model.exit, also of the forward with the per-token exit), and
  whether `greedy` greedy tokens with transformers' KV cache equal our cached decode's at the
  trained count (the exit applied in both)."""
  import jax
  import jax.numpy as jnp
  from loopmoe_jax import decode
  from loopmoe_jax.analysis.probes import validation_inputs
  from loopmoe_jax.model import LoopedMoE, variables
  torch, transformers = packages()
  cfg = run.model_cfg
  model = transformers.AutoModelForCausalLM.from_pretrained(
      out, trust_remote_code=True, dtype=torch.float32).eval()
  inputs = np.concatenate(validation_inputs(run.config, cfg.vocab_size, tokens)[0])
  seq = min(inputs.shape[1], tokens)
  x = inputs[:max(1, tokens // seq), :seq].astype(np.int32)
  var = variables(run.params, router_bias=run.router_bias)
  errors, exit_errors, scale = {}, {}, 0.0
  for n in pass_counts(cfg):
    for exiting in (False, True) if cfg.exit != 'none' else (False,):
      ours = np.asarray(LoopedMoE(cfg, runtime=run.runtime).apply(
          var, jnp.asarray(x), num_loops=n, early_exit=exiting)[0], np.float32)
      with torch.no_grad():
        theirs = model(torch.tensor(x, dtype=torch.long), num_loops=n,
                       early_exit=exiting).logits.numpy()
      (exit_errors if exiting else errors)[n] = float(np.max(np.abs(theirs - ours)))
      scale = max(scale, float(np.max(np.abs(ours))))
  prompt = x[:1, :min(16, seq)]
  ours = np.asarray(decode.generate(cfg, run.params, jnp.asarray(prompt), greedy,
                                    jax.random.key(0), 0.0, router_bias=run.router_bias,
                                    runtime=run.runtime))
  with torch.no_grad():
    theirs = model.generate(torch.tensor(prompt, dtype=torch.long), max_new_tokens=greedy,
                            do_sample=False, attention_mask=torch.ones(prompt.shape,
                                                                       dtype=torch.long)).numpy()
  out = {'step': run.step, 'tokens': int(x.size),
         'max_abs_logit_error': max([*errors.values(), *exit_errors.values()]),
         'by_num_loops': errors, 'logit_scale': scale, 'greedy_tokens': greedy,
         'greedy_equal': bool(np.array_equal(ours, theirs))}
  if exit_errors:  # the forward with the per-token exit (early_exit=True), model.exit's
    out['by_num_loops_exit'] = exit_errors
  return out
