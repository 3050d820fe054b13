"""The LM Evaluation Harness (lm-eval, an optional dependency: pip install 'loopmoe_jax[lm_eval]')
on our checkpoints, at any pass count.

    lm = LoopedMoELM(workdir, num_loops=2)           # a workdir or a run.Loaded
    out = evaluate(workdir, ['loopmoe_next_line'], num_loops=(1, 2, 4), limit=100)
    # scripts/lm_eval.py writes out['passes'] as results.json and `table(out)` as table.md

`LoopedMoELM` is an `lm_eval.api.model.LM` that answers the harness's three requests with our
model and our decode, in the run's own tokenizer (data/tokenizers.py: byte-level or a tokenizers
JSON), at `num_loops` passes through the core (model.check_loops refuses a count the weights
cannot run, before any compute):

- loglikelihood(context, continuation): the summed log-probability (float32, nats) of the
  continuation's tokens after the context's, from one full forward (`LoopedMoE.apply`), and
  whether each of them is the argmax (is_greedy). Tokens (the harness's rules for its own
  models): the context's trailing whitespace moves to the front of the continuation; the text
  context + continuation is encoded whole and split after the context's own encoding (a merge
  across the boundary falls back to encoding the two apart); an empty context is the EOS token
  (the document separator the model was trained with).
- loglikelihood_rolling(text): the summed log-probability of every token of the text after an
  EOS, the text cut into windows of the trained length (below).
- generate_until(context, gen_kwargs): `decode.generate` (greedy unless gen_kwargs ask for
  do_sample with a temperature) for max_gen_toks tokens (default 256), cut at the first EOS and
  then before each of the `until` strings in turn.

Lengths. The model was trained on windows of data.seq_len tokens (M). A scored sequence longer
than that is cut from the LEFT: the context keeps its last tokens (a warning counts the requests
cut); a continuation (or a rolling text) longer than M is scored in windows of M predictions,
each window predicted from the M tokens before its end, so every token is scored once with at
least its window's earlier tokens as context. A generation prompt keeps its last
max(M - max_gen_toks, M // 2) tokens (the harness keeps M - max_gen_toks; the floor keeps a
usable prompt when max_gen_toks is near M); what it generates may run past M.

Batching. Windows are right-padded (the model is causal, padding after a token cannot change its
score) to the smallest of a few lengths (`buckets`: powers of two from 32 up to M, and M) and
packed into batches of `batch_size` rows (short batches padded with empty rows), so a pass count
compiles one program per bucket. The scores are the same batched or one at a time for a dropless
model (model.capacity_factor=0, the default); with a capacity factor the padding tokens take
expert capacity like real ones. Generation groups prompts of the same length and settings into
batches of `batch_size` and compiles `generate` once per (prompt length, max_gen_toks).

The offline task pack (loopmoe_jax/lm_tasks/) is registered with `task_manager`; `evaluate` runs
`lm_eval.simple_evaluate` once per pass count. Runs on this process's first device, or on a
mesh (`mesh=`; scripts/lm_eval.py --mesh=data=2,expert=4): the params sharded as for training,
each scoring batch's rows split over the mesh's batch axes.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import logging
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

try:
  import lm_eval
  from lm_eval.api.model import LM
except ImportError as e:  # pragma: no cover - the optional dependency is absent
  raise ImportError("the LM Evaluation Harness is not installed: pip install lm-eval==0.4.13 "
                    "(or pip install -e '.[lm_eval]')") from e

from loopmoe_jax import sharding
from loopmoe_jax.config import ModelConfig
from loopmoe_jax.data import pipeline
from loopmoe_jax.decode import generate
from loopmoe_jax.lm_tasks import PACK_DIR
from loopmoe_jax.model import LoopedMoE, check_loops, variables
from loopmoe_jax.objective import token_nll_of_logits
from loopmoe_jax.runtime import HERE, Runtime
from loopmoe_jax.train import step as steps
from loopmoe_jax.train.run import load_on

log = logging.getLogger(__name__)


class _QuietCustomDataset(logging.Filter):
  """Drops the harness's note, at every load of a task with a `custom_dataset` (the pack's),
  that such a task takes keywords from --metadata (the pack's take none)."""

  def filter(self, record):
    return 'Custom kwargs can be passed' not in record.getMessage()


logging.getLogger('lm_eval.api.task').addFilter(_QuietCustomDataset())


@dataclasses.dataclass(frozen=True)
class AdapterConfig:
  """How the adapter runs a checkpoint: passes (None: the trained count), rows per batch, the
  padded lengths of a scored window (default: powers of two from 32 up to the trained length)
  and the seed of sampled generation (greedy ignores it)."""
  num_loops: int | None = None
  batch_size: int = 16
  buckets: tuple[int, ...] = ()
  seed: int = 0

  def __post_init__(self):
    if self.batch_size < 1:
      raise ValueError(f'batch_size={self.batch_size}: must be >= 1')


def default_buckets(max_length: int) -> tuple[int, ...]:
  sizes = [n for n in (2 ** i for i in range(5, 20)) if n < max_length]
  return tuple(sizes) + (max_length,)


@functools.lru_cache(maxsize=None)
def _token_scores(cfg: ModelConfig, num_loops: int | None, mesh=None, *, runtime: Runtime):
  """jit of (params, router bias, inputs_BT, targets_BT) -> (log p of each target [B, T] float32,
  target == argmax [B, T]): one full forward. Compiled once per shape (a bucket); under `mesh`
  (the batch's rows split over its batch axes, the params as the rules table shards them);
  `runtime`: the run's (its stored run settings)."""
  model = LoopedMoE(cfg, runtime=runtime)

  def fn(params, bias, inputs_BT, targets_BT):
    logits_BTV, _ = model.apply(variables(params, router_bias=bias), inputs_BT,
                                num_loops=num_loops)
    return -token_nll_of_logits(logits_BTV, targets_BT), jnp.argmax(logits_BTV, -1) == targets_BT
  return steps.OnMesh(jax.jit(fn), mesh) if mesh is not None else jax.jit(fn)


def windows(length: int, start: int, max_length: int) -> list[tuple[int, int, int]]:
  """The scored windows of a sequence of `length` tokens whose tokens [start, length) are
  scored, each predicted from what precedes it: (lo, end, n), the window's inputs seq[lo:end-1]
  predicting seq[lo+1:end], its last n predictions scored; at most `max_length` inputs a window,
  in order, the last one ending at the sequence's end (the module docstring, Lengths)."""
  if not 1 <= start <= length:
    raise ValueError(f'windows: start={start} must lie in [1, {length}]')
  out, end = [], length
  while end > start:
    first = max(start, end - max_length)
    out.append((max(0, end - 1 - max_length), end, end - first))
    end = first
  return out[::-1]


class LoopedMoELM(LM):
  """The harness's model: a checkpoint (a workdir or a run.Loaded) at `num_loops` passes."""

  def __init__(self, run, num_loops: int | None = None, batch_size: int = 16,
               step: int | None = None, buckets: Sequence[int] = (), seed: int = 0,
               mesh=None):
    """`mesh` (a jax Mesh of sharding.make_mesh, or None: this process's first device):
    scoring runs on it, each batch's rows split over its batch axes (`batch_size` must be a
    multiple of their size); a workdir's params are read sharded onto it."""
    super().__init__()
    self.settings = AdapterConfig(num_loops, int(batch_size), tuple(buckets), seed)
    self.mesh = mesh
    if mesh is not None and batch_size % sharding.batch_size_of(mesh):
      raise ValueError(f'--batch_size={batch_size}: must be a multiple of the mesh\'s batch '
                       f'axes ({sharding.batch_size_of(mesh)} devices)')
    self.run = load_on(run, mesh, step)
    # every pass runs, scoring and generating alike (a checkpoint's model.exit would make
    # decode.generate exit early)
    self.cfg = self.run.model_cfg.replace(exit='none')
    self.passes = check_loops(self.cfg, num_loops)
    self.tokenizer = pipeline.data_tokenizer(self.run.exp.data)
    if self.tokenizer is None:
      raise ValueError(f'{self.run.workdir}: the tokenizer of its training data '
                       f'({pipeline.tokenizer_spec(self.run.exp.data)!r}) cannot be loaded')
    self.max_length = int(self.run.exp.data.seq_len)
    self.buckets = tuple(sorted(set(self.settings.buckets or default_buckets(self.max_length))))
    if self.buckets[-1] < self.max_length:
      raise ValueError(f'buckets={self.buckets}: the largest must be >= the trained length '
                       f'{self.max_length}')
    self._score_fn = _token_scores(self.cfg, num_loops, mesh, runtime=self.run.runtime)
    self._rows = sharding.batch_sharding(mesh) if mesh is not None else None

  # Tokens ---------------------------------------------------------------------------------

  @property
  def eos_id(self) -> int:
    return int(self.tokenizer.eos_id)

  def encode(self, text: str) -> list[int]:
    return [int(i) for i in self.tokenizer.encode(text)]

  def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """(context tokens, continuation tokens), see the module docstring."""
    spaces = len(context) - len(context.rstrip())  # the context's trailing whitespace joins
    if spaces:                                     # the continuation (the harness's rule)
      context, continuation = context[:-spaces], context[-spaces:] + continuation
    ctx = self.encode(context) if context else []
    whole = self.encode(context + continuation)
    cont = whole[len(ctx):] if whole[:len(ctx)] == ctx else self.encode(continuation)
    return (ctx or [self.eos_id]), cont

  # Scoring --------------------------------------------------------------------------------

  def score(self, items: Sequence[tuple[Sequence[int], int]]) -> list[tuple[float, bool]]:
    """(summed log p, all greedy) of seq[start:] for each (seq, start), batched."""
    parts = [(i, w) for i, (seq, start) in enumerate(items)
             for w in windows(len(seq), start, self.max_length)]
    width = lambda j: parts[j][1][1] - 1 - parts[j][1][0]  # the window's inputs
    logp, greedy = [0.0] * len(items), [True] * len(items)
    groups: dict[int, list[int]] = {}
    for j in sorted(range(len(parts)), key=lambda j: -width(j)):
      groups.setdefault(next(b for b in self.buckets if b >= width(j)), []).append(j)
    rows = self.settings.batch_size
    for bucket, members in groups.items():
      for s in range(0, len(members), rows):
        chunk = members[s:s + rows]
        inputs_BT = np.zeros((rows, bucket), np.int32)
        targets_BT = np.zeros((rows, bucket), np.int32)
        for r, j in enumerate(chunk):
          i, (lo, end, _) = parts[j]
          seq = items[i][0]
          inputs_BT[r, :end - 1 - lo], targets_BT[r, :end - 1 - lo] = (seq[lo:end - 1],
                                                                        seq[lo + 1:end])
        put = (jnp.asarray if self._rows is None else
               (lambda a: jax.device_put(a, self._rows)))
        lp_BT, ok_BT = self._score_fn(self.run.params, self.run.router_bias,
                                      put(inputs_BT), put(targets_BT))
        lp_BT, ok_BT = np.asarray(lp_BT, np.float64), np.asarray(ok_BT)
        for r, j in enumerate(chunk):
          i, (_, _, n) = parts[j]
          scored = slice(width(j) - n, width(j))
          logp[i] += float(lp_BT[r, scored].sum())
          greedy[i] = greedy[i] and bool(ok_BT[r, scored].all())
    return list(zip(logp, greedy))

  def _warn_cut(self, cut: int, total: int, what: str) -> None:
    if cut:
      log.warning(f'{cut} of {total} {what} requests are longer than the {self.max_length} '
                  'tokens the model was trained on: their contexts were cut from the left')

  def loglikelihood(self, requests) -> list[tuple[float, bool]]:
    items = []
    for req in requests:
      ctx, cont = self.encode_pair(*req.args)
      items.append((ctx + cont, len(ctx)))
    self._warn_cut(sum(len(s) - 1 > self.max_length for s, _ in items), len(items),
                   'loglikelihood')
    out = self.score(items)
    for req, res in zip(requests, out):
      self.cache_hook.add_partial('loglikelihood', req.args, res)
    return out

  def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
    del disable_tqdm
    out = [lp for lp, _ in self.score([([self.eos_id] + self.encode(req.args[0]), 1)
                                       for req in requests])]
    for req, res in zip(requests, out):
      self.cache_hook.add_partial('loglikelihood_rolling', req.args, res)
    return out

  # Generation -----------------------------------------------------------------------------

  def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
    del disable_tqdm
    jobs = []
    for req in requests:
      context, kw = req.args
      kw = dict(kw or {})
      until = kw.pop('until', None) or []
      until = [until] if isinstance(until, str) else list(until)
      steps = int(kw.pop('max_gen_toks', 256))
      temp = float(kw.pop('temperature', 0.0)) if kw.pop('do_sample', False) else 0.0
      ids = self.encode(context) or [self.eos_id]
      keep = max(self.max_length - steps, self.max_length // 2)
      jobs.append((ids[-keep:], steps, temp, until, len(ids) > keep))
    self._warn_cut(sum(j[4] for j in jobs), len(jobs), 'generate_until')
    out: list[str | None] = [None] * len(jobs)
    groups: dict[tuple, list[int]] = {}
    for i, (ids, steps, temp, _, _) in enumerate(jobs):
      groups.setdefault((len(ids), steps, temp), []).append(i)
    rows = self.settings.batch_size
    for g, ((_, steps, temp), members) in enumerate(groups.items()):
      for s in range(0, len(members), rows):
        chunk = members[s:s + rows]
        prompt_BT = np.asarray([jobs[i][0] for i in chunk] +
                               [jobs[chunk[0]][0]] * (rows - len(chunk)), np.int32)
        key = jax.random.fold_in(jax.random.key(self.settings.seed), g * len(jobs) + s)
        new_BS = np.asarray(generate(self.cfg, self.run.params, jnp.asarray(prompt_BT), steps,
                                     key, temperature=temp,
                                     num_loops=self.settings.num_loops,
                                     router_bias=self.run.router_bias,
                                     runtime=self.run.runtime))[:, prompt_BT.shape[1]:]
        for r, i in enumerate(chunk):
          out[i] = cut_text(self.tokenizer, new_BS[r], jobs[i][3])
    for req, res in zip(requests, out):
      self.cache_hook.add_partial('generate_until', req.args, res)
    return out

  def get_model_info(self) -> dict:
    return {'workdir': self.run.workdir, 'step': self.run.step, 'num_loops': self.passes,
            'max_length': self.max_length, 'tokenizer': self.tokenizer.name}


def cut_text(tokenizer, ids, until: Sequence[str]) -> str:
  """The text of generated `ids` up to the first EOS, then cut before each `until` string in
  turn (the harness's own models' rule)."""
  ids = [int(i) for i in ids]
  if tokenizer.eos_id in ids:
    ids = ids[:ids.index(tokenizer.eos_id)]
  text = tokenizer.decode(ids)
  for stop in until:
    if stop and stop in text:
      text = text[:text.index(stop)]
  return text


# Tasks and runs -----------------------------------------------------------------------------

def task_manager(include_defaults: bool = True):
  """The harness's TaskManager with the offline pack (loopmoe_jax/lm_tasks) registered, and the
  harness's own tasks unless `include_defaults` is False (indexing them takes seconds)."""
  from lm_eval.tasks import TaskManager
  return TaskManager(include_path=PACK_DIR, include_defaults=include_defaults)


def check_tasks(names: Sequence[str], manager) -> list[str]:
  """`names` as given; a name the manager does not know is a ValueError listing near names."""
  if not names:
    raise ValueError('--tasks is empty: name at least one task (e.g. loopmoe_next_line)')
  known = manager.all_tasks
  for name in names:
    if name not in known:
      near = difflib.get_close_matches(name, known, n=5, cutoff=0.6)
      hint = f'near names: {", ".join(near)}' if near else 'the offline pack has ' + ', '.join(
          t for t in known if t.startswith('loopmoe'))
      raise ValueError(f'unknown task {name!r} (lm-eval {lm_eval.__version__}); {hint}')
  return list(names)


def chance(task, limit: int | None = None) -> float | None:
  """A multiple-choice task's accuracy by guessing (the mean of 1 / its number of choices over
  the documents evaluated: the first `limit`); None for another kind of task."""
  if task.OUTPUT_TYPE != 'multiple_choice':
    return None
  docs = list(task.eval_docs)[:limit] if limit else list(task.eval_docs)
  return float(np.mean([1.0 / len(task.doc_to_choice(d)) for d in docs]))


def evaluate(run, tasks: Sequence[str], num_loops: Sequence[int | None] = (None,),
             limit: int | None = None, batch_size: int = 16, step: int | None = None,
             manager=None, bootstrap_iters: int = 1000, mesh=None) -> dict:
  """{'passes': {str(passes): the harness's results (JSON-safe)}, 'wall_s': {str(passes): s},
  'chance': {task: p}, 'step', 'workdir'}: lm_eval.simple_evaluate of `tasks` at each pass
  count (every count and task checked before any is evaluated), on `mesh` when given
  (LoopedMoELM's)."""
  import json
  from lm_eval.utils import handle_non_serializable
  loaded = load_on(run, mesh, step)
  counts = [check_loops(loaded.model_cfg, n) for n in num_loops]
  manager = manager or task_manager()
  tasks = check_tasks(tasks, manager)
  loaded_tasks = manager.load(list(tasks))['tasks']
  out = {'workdir': loaded.workdir, 'step': loaded.step, 'limit': limit,
         'chance': {name: chance(t, limit) for name, t in loaded_tasks.items()},
         'passes': {}, 'wall_s': {}}
  for n in counts:
    start = time.perf_counter()
    lm = LoopedMoELM(loaded, num_loops=n, batch_size=batch_size, mesh=mesh)
    res = lm_eval.simple_evaluate(model=lm, tasks=list(tasks), limit=limit, task_manager=manager,
                                  log_samples=False, bootstrap_iters=bootstrap_iters,
                                  verbosity='WARNING')
    out['wall_s'][str(n)] = time.perf_counter() - start
    out['passes'][str(n)] = json.loads(json.dumps(res, default=handle_non_serializable))
  return out


METRICS = ('acc', 'acc_norm', 'acc_mutual_info', 'exact_match', 'word_perplexity', 'bits_per_byte')


def table(out: dict) -> str:
  """Markdown: a row per (task, metric), a column per pass count (the value, then ± its
  standard error where the harness gives one), chance where known, and a row of wall seconds
  per pass count."""
  passes = list(out['passes'])
  head = '| task | metric | chance | ' + ' | '.join(f"{p} pass{'es' if p != '1' else ''}" for p in passes) + ' |'
  lines = [head, '|' + '---|' * (3 + len(passes))]
  tasks = sorted({t for res in out['passes'].values() for t in res.get('results', {})})

  def cell(res, metric):
    value, err = res.get(f'{metric},none'), res.get(f'{metric}_stderr,none')
    if not isinstance(value, (int, float)):
      return '-'
    return f'{value:.3f}' + (f' ± {err:.3f}' if isinstance(err, (int, float)) else '')

  for task in tasks:
    for metric in METRICS:
      cells = [cell(out['passes'][p].get('results', {}).get(task, {}), metric) for p in passes]
      if all(c == '-' for c in cells):
        continue
      odds = out['chance'].get(task) if metric.startswith('acc') else None
      lines.append(f'| {task} | {metric} | {"-" if odds is None else f"{odds:.3f}"} | ' +
                   ' | '.join(cells) + ' |')
  lines.append('| (wall time) | s | | ' + ' | '.join(f'{out["wall_s"][p]:.1f}' for p in passes)
               + ' |')
  return '\n'.join(lines) + '\n'
