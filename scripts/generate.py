"""Samples text from a checkpoint: one prompt, or a JSON-lines file of prompts in batches.

    python scripts/generate.py --workdir=/tmp/run --prompt='def ' --tokens=200 [--step=300]
        [--kv_cache=last_pass]   # the core's KV cache shared by the passes (decode.py)
    python scripts/generate.py --workdir=/tmp/run --prompts=prompts.jsonl --batch_size=8 \\
        --out=out.jsonl --temperature=0.8 --top_k=40 --top_p=0.95 --stop='\n'
    python scripts/generate.py --workdir=/tmp/run --prompt='def ' --temperature=0 \\
        --speculative --draft_loops=1 --lookahead=4   # loop-draft: greedy's tokens, faster

Prompts file: one line a prompt, {"prompt": "..."} or a JSON string; --out gets one JSON row a
prompt ({"prompt", "text", "tokens", "stopped"}, with --speculative the acceptance rate and
passes per token), in the input order; without --out the prompt and its text are printed.
Prompts of different lengths share a batch, each row what it would be alone (batched.py).
--speculative drafts --lookahead tokens with the first --draft_loops passes of the core and
verifies them with the rest (speculative.py; batch 1, model.kv_cache='per_pass').
On a TPU or a GPU the KV cache is read in Pallas kernels (pallas_kernels/decode_attention.py,
decode_attention_gpu.py); --attention_impl=xla keeps XLA's products.
"""
import math

from absl import flags

from loopmoe_jax.cli import (check_output_file, distributed_flags, initialize_distributed,
                             main_process, run)
from loopmoe_jax.config import ATTENTION_IMPLS

_WORKDIR = flags.DEFINE_string('workdir', None, 'Run directory.', required=True)
_PROMPT = flags.DEFINE_string('prompt', 'def ', 'Prompt text (ignored with --prompts).')
_PROMPTS = flags.DEFINE_string('prompts', None, 'JSON-lines file of prompts.')
_OUT = flags.DEFINE_string('out', None, 'Write the results here as JSON lines.')
_BATCH = flags.DEFINE_integer('batch_size', 8, 'Prompts decoded together.')
_TOKENS = flags.DEFINE_integer('tokens', 200, 'Tokens to generate (at most) per prompt.')
_TEMP = flags.DEFINE_float('temperature', 0.8, 'Sampling temperature (0: greedy).')
_TOP_K = flags.DEFINE_integer('top_k', 0, 'Sample among the k most likely tokens (0: all).')
_TOP_P = flags.DEFINE_float('top_p', 1.0, 'Nucleus: the smallest set of this mass (1: all).')
_STOP = flags.DEFINE_list('stop', [], 'Stop strings (one token each): a row ends after one.')
_SEED = flags.DEFINE_integer('seed', 0, 'Sampling seed.')
_LOOPS = flags.DEFINE_integer('num_loops', None, 'Passes through the core (tied models).')
_STEP = flags.DEFINE_integer('step', None, 'Checkpoint step (default: latest readable).')
_SCALE = flags.DEFINE_enum('scale_passes', None, ['trained', 'executed'],
                           'r of the 1/r residual scale at another pass count.')
_KV = flags.DEFINE_string('kv_cache', None, "The core's KV-cache layout, model.kv_cache "
                          "(per_pass, last_pass, first_pass; default: the model's).")
_SPEC = flags.DEFINE_bool('speculative', False, 'Loop-draft speculative decoding (batch 1).')
_DRAFT = flags.DEFINE_integer('draft_loops', 1, 'Core passes of the draft (< the pass count).')
_LOOKAHEAD = flags.DEFINE_integer('lookahead', 4, 'Tokens drafted per round.')
_ATTENTION = flags.DEFINE_string('attention_impl', None, "The run's run.attention_impl replaced "
                                 "(on a TPU or a GPU, 'xla': XLA's decode products instead of "
                                 'the Pallas decode kernels).')
_DISTRIBUTED = distributed_flags()


def check_sampling(temperature: float, tokens: int, top_k: int = 0, top_p: float = 1.0) -> None:
  """The sampling flags, before the checkpoint loads: a ValueError naming the flag."""
  if not (math.isfinite(temperature) and temperature >= 0):
    raise ValueError(f'--temperature={temperature}: must be a finite number >= 0 (0: greedy)')
  if tokens < 1:
    raise ValueError(f'--tokens={tokens}: must be >= 1')
  if top_k < 0:
    raise ValueError(f'--top_k={top_k}: must be >= 0 (0: every token)')
  if not (math.isfinite(top_p) and 0 < top_p <= 1):
    raise ValueError(f'--top_p={top_p}: must lie in (0, 1] (1: every token)')


def check_decoding() -> None:
  """The batching and speculative flags, before the checkpoint loads."""
  if _BATCH.value < 1:
    raise ValueError(f'--batch_size={_BATCH.value}: must be >= 1')
  if _SPEC.value:
    if _LOOKAHEAD.value < 1:
      raise ValueError(f'--lookahead={_LOOKAHEAD.value}: must be >= 1 (tokens drafted a round)')
    if _DRAFT.value < 0:
      raise ValueError(f'--draft_loops={_DRAFT.value}: must be >= 0 and below the pass count')
  if _ATTENTION.value is not None and _ATTENTION.value not in ATTENTION_IMPLS:
    raise ValueError(f'--attention_impl={_ATTENTION.value}: must be one of '
                     f'{", ".join(ATTENTION_IMPLS)}')
  check_output_file('--out', _OUT.value)


def main(argv):
  del argv
  check_sampling(_TEMP.value, _TOKENS.value, _TOP_K.value, _TOP_P.value)
  check_decoding()
  initialize_distributed(_DISTRIBUTED)  # every process samples the same; process 0 prints
  from loopmoe_jax import text_generation as tg
  from loopmoe_jax.sampling import Sampling
  prompts = tg.read_prompts(_PROMPTS.value) if _PROMPTS.value else [_PROMPT.value]
  if not all(prompts):
    raise ValueError('--prompt is empty')
  opts = tg.Options(tokens=_TOKENS.value, sampling=Sampling(_TEMP.value, _TOP_K.value,
                                                            _TOP_P.value),
                    seed=_SEED.value, batch_size=_BATCH.value, num_loops=_LOOPS.value,
                    step=_STEP.value, scale_passes=_SCALE.value, kv_cache=_KV.value,
                    stop=tuple(_STOP.value),
                    speculative=(_DRAFT.value, _LOOKAHEAD.value) if _SPEC.value else None,
                    attention_impl=_ATTENTION.value)
  rows = tg.generate_texts(_WORKDIR.value, prompts, opts)
  if not main_process():
    return
  if _OUT.value:
    tg.write_rows(_OUT.value, rows)
    print(f'{len(rows)} rows -> {_OUT.value}')
  else:
    for row in rows:
      print(row['prompt'] + row['text'])


if __name__ == '__main__':
  run(main)
