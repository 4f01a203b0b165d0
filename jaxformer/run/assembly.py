"""A training run assembled from its config, before the first step: the
pretrained start's config, the tokenizers, the `RunSpec` (as `jaxformer
compile` builds it), what a resume must match, this host's part of the
data, and the evaluator; the splits it reads are checked now, so that a
bad file is reported before any training time is spent."""
import dataclasses
import functools
from typing import Any

import jax
import ml_collections

from jaxformer.checkpoints import manager as checkpoint_lib
from jaxformer.checkpoints import saved_state as saved_state_lib
from jaxformer.config import resume
from jaxformer.data import language_tokenizer
from jaxformer.data import task_batches
from jaxformer.data import token_cache as token_cache_lib
from jaxformer.data import tokenizer as tokenizer_lib
from jaxformer.parallel import peers
from jaxformer.run import host_plan
from jaxformer.run import pretrained
from jaxformer.run import evaluation
from jaxformer.run.evaluation import Evaluator
from jaxformer.storage import paths
from jaxformer.train import run_spec
from jaxformer.train.tasks import get_task


@dataclasses.dataclass(frozen=True)
class Assembled:
  """What a run is, once set up.

  tokenizers: [source, target] (one object twice when joint).
  plan: this host's part of the run (`run/host_plan.py`).
  token_cache: where tokenized splits are kept (None: not kept).
  saved_state: what the checkpoints hold of the train state.
  """
  spec: run_spec.RunSpec
  tokenizers: tuple[tokenizer_lib.Tokenizer, tokenizer_lib.Tokenizer]
  plan: host_plan.HostPlan
  token_cache: Any
  evaluator: Evaluator
  saved_state: saved_state_lib.SavedState


def assemble(config: ml_collections.ConfigDict, workdir: str,
             checkpoints: checkpoint_lib.Checkpointer, devices=None,
             scorer: evaluation.Scorer | None = None) -> Assembled:
  """The run of `config` in `workdir` on `devices` (default: all, as
  `jax.make_mesh` orders them), its evaluator scoring translations with
  `scorer` too (eval.comet's); writes WORKDIR/config.json (process 0)
  and, for a pretrained start, the export's tokenizers."""
  evaluation.check_scorer(config, scorer)  # Before any work.
  config, pretrained_tokenizers = pretrained.pretrained_start(config)
  if pretrained_tokenizers:
    pretrained.write_tokenizers(config.data, workdir, pretrained_tokenizers)
  # Process 0's tokenizer hash and token-cache keys are every process's.
  agree = (functools.partial(
      peers.from_process_0,
      timeout_seconds=config.data.tokenizer.get('wait_seconds', 3600))
           if jax.process_count() > 1 else None)
  tokenizers = language_tokenizer.bind_pair(*tokenizer_lib.get_or_train(
      config.data, workdir, agree=agree,
      with_labels=get_task(config.task).label is not None), config.data)
  spec = run_spec.RunSpec.build(
      config, run_spec.run_mesh(config, devices), tokenizers)
  plan = _resume_and_plan(spec, tuple(tokenizers), workdir, checkpoints)
  saved_state = saved_state_lib.of_run(spec, checkpoints.newest_extra())
  checkpoints.extra.update(saved_state.extra)
  token_cache = token_cache_lib.directory(spec.config.data, workdir)
  if agree and token_cache:
    token_cache = token_cache_lib.SharedCache(token_cache, agree)
  evaluator = Evaluator(spec, tokenizers, plan.share, token_cache, scorer)
  _check_splits(spec, evaluator, token_cache)
  return Assembled(spec, tuple(tokenizers), plan, token_cache, evaluator,
                   saved_state)


def _resume_and_plan(spec: run_spec.RunSpec, tokenizers, workdir: str,
                     checkpoints: checkpoint_lib.Checkpointer
                     ) -> host_plan.HostPlan:
  """Checks that the newest checkpoint's config and data order may be
  resumed with (`config/resume.py`), writes the run's config, and lays
  out this host's part of the run: layout and batch shapes are checked
  now, not hours in at a first use, by the code `jaxformer compile` runs
  for every host of a pod."""
  config = spec.config
  resume.check_compatible(checkpoints, config, resume.option_defaults())
  checkpoints.set_extra(config, tokenizers)
  if jax.process_index() == 0:
    paths.write_text(paths.join(workdir, 'config.json'),
                     config.to_json_best_effort(indent=2))
  plan = host_plan.plan_host(config, spec.mesh, jax.process_index())
  resume.use_data_order(checkpoints, plan.data_order,
                        config.data.allow_new_data_order)
  return plan


def _check_splits(spec: run_spec.RunSpec, evaluator: Evaluator,
                  token_cache) -> None:
  """Reads the train files and the splits evaluated during and after
  training (a first batch of each)."""
  config = spec.config
  task_batches.check_train_files(config, jax.process_index(), token_cache)
  splits = {config.eval.split}
  if spec.task.translates and config.eval.final_split:
    splits.add(config.eval.final_split)
  for split in sorted(splits):
    next(iter(evaluator.batches(split)), None)
