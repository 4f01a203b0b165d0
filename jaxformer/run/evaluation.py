"""Evaluation during training: loss metrics of the eval split (BLEU too
for translation, and a scorer's metrics of the same translations, COMET's
with eval.comet; the encoder-only tasks' `dev_metrics`, from every
example's prediction)."""
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer.data import sources as sources_lib
from jaxformer.data import task_batches
from jaxformer.inference import evaluate as evaluate_lib
from jaxformer.parallel import mesh as mesh_lib
from jaxformer.parallel.row_share import RowShare
from jaxformer.train import ema as ema_lib
from jaxformer.train import loss as losses
from jaxformer.train.run_spec import RunSpec

# (sources, hypotheses, references) -> metrics of the translations, such as
# {'comet': the system score}.
Scorer = Callable[[Sequence[str], Sequence[str], Sequence[str]],
                  dict[str, float]]


def check_scorer(config, scorer: Scorer | None) -> None:
  """eval.comet needs a scorer from the caller: this layer cannot load a
  COMET model (interop/ is above it)."""
  if config.eval.get('comet') and scorer is None:
    raise ValueError(
        f'eval.comet={config.eval.comet!r} is set and no scorer was passed: '
        'give the run one, Trainer(config, workdir, scorer='
        'jaxformer.cli.train_commands.comet_scorer(config.eval.comet)), or '
        'unset eval.comet.')


def check_best_metric(config, task, scorer: Scorer | None) -> None:
  """checkpoint.best_metric is one of the task's metrics ('comet' only
  where a scorer gives it)."""
  best, known = config.checkpoint.best_metric, task.eval_metrics
  if best == 'comet' and scorer is None:
    raise ValueError("checkpoint.best_metric='comet' needs eval.comet: set "
                     'eval.comet to a COMET checkpoint folder, or choose '
                     'another best metric.')
  accepted = known + (('comet',) if scorer else ())
  if best and known and best not in accepted:
    raise ValueError(
        f'checkpoint.best_metric={best!r} is not a metric of task '
        f'{task.name!r}: choose one of {list(accepted)} (or \'\' to keep '
        'no best checkpoint).')


class Evaluator:
  """Evaluates parameters of `run` on its eval split; each process reads
  the rows of its `share`. The eval step is compiled once per run.
  `scorer` also scores the translations decoded for BLEU."""

  def __init__(self, run: RunSpec, tokenizers, share: RowShare,
               token_cache=None, scorer: Scorer | None = None):
    check_scorer(run.config, scorer)
    check_best_metric(run.config, run.task, scorer)
    self.run = run
    self.source_tok, self.target_tok = tokenizers
    self.share = share
    self.token_cache = token_cache
    self.scorer = scorer
    self._eval_fn = None

  def batches(self, split: str):
    """This process's rows of every batch of `split`."""
    return task_batches.eval_batches(
        self.run.config, self.source_tok, self.target_tok, split,
        process_index=jax.process_index(), share=self.share,
        token_cache=self.token_cache)

  def of_state(self, state) -> dict[str, float]:
    """The metrics of `state.params`, and those of their moving average
    prefixed ema_ if the state keeps one (logged as eval_ema_*)."""
    metrics = self(state.params)
    if ema_lib.of(state) is not None:
      ema = self(ema_lib.as_params(state.ema, state.params))
      metrics.update({f'ema_{key}': value for key, value in ema.items()})
    return metrics

  def __call__(self, params) -> dict[str, float]:
    """Loss metrics on the eval split (and BLEU for translation)."""
    run, eval_config = self.run, self.run.config.eval
    if self._eval_fn is None:
      self._eval_fn = run.eval_step(jax.tree.map(lambda x: x.sharding, params))
    totals, rows = None, []
    for index, local in enumerate(self.batches(eval_config.split)):
      if eval_config.num_batches and index >= eval_config.num_batches:
        break
      local = {k: v for k, v in local.items() if k != 'example_index'}
      sums, batch_rows = self._eval_fn(
          params, mesh_lib.global_batch(local, run.mesh))
      totals = sums if totals is None else jax.tree.map(jnp.add, totals, sums)
      rows.append(jax.device_get(batch_rows))
    metrics = {k: float(np.asarray(v))
               for k, v in jax.device_get(losses.summarise(totals)).items()
               if np.ndim(v) == 0 and k != 'weight'}
    if run.task.dev_metrics is not None:
      metrics.update(run.task.dev_metrics(_real_rows(rows)))
    if run.task.translates and eval_config.bleu_examples:
      metrics.update(self.translation_scores(params))
    return metrics

  def translation_scores(self, params) -> dict[str, float]:
    """BLEU, chrF and exact match of the eval split's first bleu_examples
    sentences decoded greedily, and the scorer's metrics of them."""
    run, split = self.run, self.run.config.eval.split
    scores, hypotheses = evaluate_lib.decode_split(
        params, run.model_config, run.config, self.source_tok,
        self.target_tok, split, run.mesh,
        max_examples=run.config.eval.bleu_examples, beam_size=1)
    if self.scorer is not None:
      pairs = sources_lib.read_split(run.config.data, split)[:len(hypotheses)]
      scores.update(self.scorer([source for source, _ in pairs], hypotheses,
                                [target for _, target in pairs]))
    return scores


def _real_rows(batches: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
  """The rows of every batch together, without the padding rows (weight
  0)."""
  rows = {key: np.concatenate([batch[key] for batch in batches])
          for key in batches[0]}
  real = rows.pop('weight') > 0
  return {key: value[real] for key, value in rows.items()}
