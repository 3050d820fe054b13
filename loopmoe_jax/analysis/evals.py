"""Evaluations of a checkpoint: test-time recurrence, Dyck-k in-context accuracy by shots, and
accuracy on the synthetic reasoning tasks (loopmoe_jax/data/synthetic.py).

Scoring (every task here): exact match of the whole answer under teacher-forced argmax. The
model reads prompt + answer once; the example counts as solved iff the argmax next-token
prediction at every answer position equals the answer's token. This is the same verdict as
greedy decoding of len(answer) tokens (greedy reproduces the answer iff every teacher-forced
argmax along it is right), at one forward per example. Padding after the answer is causal-
invisible. Predictors are functions tokens [B, T] int -> argmax next tokens [B, T], so
model-free predictors (an oracle, a constant) can be scored by the same code.

Dyck-k in-context (after SMELT's Dyck evaluation, which reports accuracy by shots; the
prompt format here is this project's): a query is an unfinished Dyck-k word 'D:<prefix>=';
the expected answer is its closing sequence; `shots` complete solved examples
('D:<prefix>=<closing>') precede it, separated by SEPARATOR. A shot count whose prompts do
not fit the context is refused (reported with the length it needs), never truncated.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from loopmoe_jax.config import ModelConfig
from loopmoe_jax.data import pipeline, synthetic
from loopmoe_jax.model import LoopedMoE, check_loops, variables
from loopmoe_jax.plotting import pyplot
from loopmoe_jax.runtime import HERE, Runtime
from loopmoe_jax.train.evaluation import evaluate_checkpoint
from loopmoe_jax.train.run import as_loaded

SEPARATOR = '\n'
SHOTS = (0, 1, 2, 4, 8, 16, 32)
TASKS = ('parity', 'addition', 'induction')
Predictor = Callable[[np.ndarray], np.ndarray]


@dataclasses.dataclass
class Prompt:
  tokens: np.ndarray   # int32 [n]: shots, query prompt, answer (byte-level)
  answer: str
  answer_start: int    # index in tokens of the answer's first byte


def dyck_prompt(seed: int, index: int, shots: int, k: int = 2, max_depth: int = 4,
                length: int = 16) -> Prompt:
  """The index-th Dyck-k query of `seed` with `shots` solved examples before it (drawn from
  independent streams (seed, index, j)); callers refuse prompts longer than their context."""
  parts = []
  for j in range(1, shots + 1):
    p, a = synthetic.dyck(np.random.default_rng([seed, index, j]), k, max_depth, length)
    parts.append(f'{p}={a}')
  query, answer = synthetic.dyck(np.random.default_rng([seed, index, 0]), k, max_depth, length)
  head = ''.join(s + SEPARATOR for s in parts) + query + '='
  text = (head + answer).encode()
  return Prompt(np.frombuffer(text, np.uint8).astype(np.int32), answer, len(head))


def exact_match(predict: Predictor, prompts: Sequence[Prompt], context: int,
                batch_size: int = 16) -> float:
  """Share of prompts whose answer is reproduced by teacher-forced argmax (see module doc)."""
  hits = []
  for s in range(0, len(prompts), batch_size):
    chunk = prompts[s:s + batch_size]
    x_BT = np.zeros((len(chunk), context), np.int32)
    for i, p in enumerate(chunk):
      x_BT[i, :p.tokens.size] = p.tokens
    pred_BT = np.asarray(predict(x_BT))
    for i, p in enumerate(chunk):
      n = len(p.answer)
      got = pred_BT[i, p.answer_start - 1:p.answer_start - 1 + n]
      hits.append(bool(np.array_equal(got, p.tokens[p.answer_start:p.answer_start + n])))
  return float(np.mean(hits)) if hits else float('nan')


def dyck_accuracy(predict: Predictor, shots: Sequence[int] = SHOTS, examples: int = 64,
                  context: int = 128, seed: int = 1234, k: int = 2, **dyck_kw) -> dict:
  """{str(shots): {'accuracy', 'examples', 'max_tokens'} or {'refused': why}} for Dyck-k
  completion at each shot count; the same queries at every shot count."""
  out = {}
  for s in shots:
    prompts = [dyck_prompt(seed, i, s, k, **dyck_kw) for i in range(examples)]
    need = max(p.tokens.size for p in prompts)
    if need > context:
      out[str(s)] = {'refused': f'{s} shots need up to {need} tokens > context {context}'}
      continue
    out[str(s)] = {'accuracy': exact_match(predict, prompts, context), 'examples': examples,
                   'max_tokens': int(need)}
  return out


def task_accuracy(predict: Predictor, task: str, examples: int = 64, seq_len: int = 128,
                  seed: int = 4321, **kw) -> float:
  """Zero-shot exact-match accuracy on a synthetic task ('parity', 'addition', 'induction',
  'dyck'), answers located by synthetic.example's answer mask."""
  prompts = []
  for i in range(examples):
    toks, mask = synthetic.example(task, seed, i, seq_len, **kw)
    pos = np.flatnonzero(mask)  # target positions t predict token t + 1
    n = int(pos.size)
    start = int(pos[0]) + 1
    text = toks[:start + n]
    answer = bytes(text[start:].astype(np.uint8)).decode()
    prompts.append(Prompt(text.astype(np.int32), answer, start))
  return exact_match(predict, prompts, seq_len + 1)


@functools.lru_cache(maxsize=None)
def _argmax_fn(cfg: ModelConfig, num_loops: int | None, runtime: Runtime):
  model = LoopedMoE(cfg, runtime=runtime)
  return jax.jit(lambda p, x: jnp.argmax(model.apply(variables(p), x,
                                                      num_loops=num_loops)[0], -1))


def model_predictor(cfg: ModelConfig, params, num_loops: int | None = None,
                    *, runtime: Runtime) -> Predictor:
  """Teacher-forced argmax of a model at `num_loops` passes (built for `runtime`), as a
  Predictor."""
  check_loops(cfg, num_loops)
  fn = _argmax_fn(cfg, num_loops, runtime)
  return lambda x_BT: np.asarray(fn(params, jnp.asarray(x_BT, jnp.int32)))


def _check_bytes(config: dict, workdir: str):
  spec = pipeline.tokenizer_spec(pipeline.DataConfig.from_dict(config['data']))
  if spec != 'byte':
    raise ValueError(f'{workdir}: the tasks are byte-level text, the run uses tokenizer '
                     f'{spec!r}')


def reasoning_evals(workdir, step: int | None = None, num_loops: int | None = None,
                    shots: Sequence[int] = SHOTS, examples: int = 64,
                    context: int | None = None) -> dict:
  """Dyck-k accuracy by shots and zero-shot parity / addition / induction accuracy of a
  checkpoint; `context` defaults to the run's data.seq_len (longer prompts are refused)."""
  run = as_loaded(workdir, step)
  cfg, params, s, config = run.model_cfg, run.variables, run.step, run.config
  _check_bytes(config, run.workdir)
  context = context or config['data']['seq_len']
  predict = model_predictor(cfg, params, num_loops, runtime=run.runtime)
  tasks = {}
  for t in TASKS:
    try:
      tasks[t] = task_accuracy(predict, t, examples, context)
    except ValueError as e:  # the task's examples do not fit the context
      tasks[t] = {'refused': str(e)}
  return {'step': s, 'num_loops': check_loops(cfg, num_loops), 'context': context,
          'scoring': 'exact match, teacher-forced argmax',
          'dyck': dyck_accuracy(predict, shots, examples, context), 'tasks': tasks}


def recurrence(workdir, max_loops: int, step: int | None = None, examples: int = 64,
               tasks: Sequence[str] = ('dyck',) + TASKS) -> dict:
  """Test-time recurrence: validation loss (train/evaluation.evaluate_checkpoint) and
  zero-shot task accuracy of one checkpoint at passes 1..max_loops."""
  loops = list(range(1, max_loops + 1))
  run = as_loaded(workdir, step)
  ev = evaluate_checkpoint(run, loops)
  cfg, params, config = run.model_cfg, run.variables, run.config
  _check_bytes(config, run.workdir)
  seq_len = config['data']['seq_len']
  acc, skipped = {t: {} for t in tasks}, {}
  for n in loops:
    predict = model_predictor(cfg, params, n, runtime=run.runtime)
    for t in list(acc):
      try:
        acc[t][str(n)] = task_accuracy(predict, t, examples, seq_len)
      except ValueError as e:  # the task's examples do not fit the trained context
        skipped[t] = str(e)
        del acc[t]
  return {'step': ev['step'], 'trained_loops': cfg.num_loops, 'passes': loops,
          'val_loss': ev['val_loss'], 'task_accuracy': acc, 'tasks_skipped': skipped,
          'scoring': 'exact match, teacher-forced argmax'}


def plot_recurrence(result: dict, path: str) -> str:
  """Validation loss and task accuracy against passes (PNG)."""
  plt = pyplot()
  passes = result['passes']
  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
  ax1.plot(passes, [result['val_loss'][str(n)] for n in passes], 'o-')
  ax1.axvline(result['trained_loops'], ls='--', c='gray', label='trained passes')
  ax1.set_xlabel('passes at test time')
  ax1.set_ylabel('validation loss (nats/token)')
  ax1.set_title(f"test-time recurrence, step {result['step']}")
  ax1.legend()
  for t, acc in result['task_accuracy'].items():
    ax2.plot(passes, [acc[str(n)] for n in passes], 'o-', label=t)
  ax2.set_xlabel('passes at test time')
  ax2.set_ylabel('exact-match accuracy (0-shot)')
  ax2.set_ylim(-0.02, 1.02)
  for ax in (ax1, ax2):
    ax.set_xticks(passes)
  ax2.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return path
