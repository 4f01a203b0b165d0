"""Fine-tuning an imported Marian or M2M100 model (configs/finetune.py,
--config.init.pretrained; M2M100's language pair from data.source_lang and
data.target_lang) is a run like any other: killed with SIGKILL and
resumed, it repeats the uninterrupted run bitwise (metrics and
parameters), and Marian's pad rows stay zero."""
import json
import pathlib
import signal
import subprocess
import time

import numpy as np
import pytest

pytest.importorskip('torch')
pytest.importorskip('transformers')

import m2m100_folders  # noqa: E402
import marian_folders  # noqa: E402

from jaxformer.cli import main as cli
from jaxformer.checkpoints import trained
from jaxformer.run import goodput  # noqa: E402
from jaxformer.run.metrics import read_metrics  # noqa: E402
from trained_runs import process_output, train_process  # noqa: E402

CONFIG = str(pathlib.Path(__file__).resolve().parents[2] / 'configs'
             / 'finetune.py')
NUM_STEPS = 8
# Wall-clock measurements, which differ between equal runs.
TIMING_KEYS = ('tokens_per_second', 'step_time', 'mfu', *goodput.FIELDS)


# The imported model and the overrides it trains with.
MODELS = {
    'marian': (lambda folder: marian_folders.write_folder(
        folder, separate=False, activation='swish', scale_embedding=True,
        encoder_layers=1, decoder_layers=1, seed=3), []),
    'm2m100': (lambda folder: m2m100_folders.write_folder(
        folder, tokenizer='m2m100', encoder_layers=1, decoder_layers=1,
        seed=3), ['data.source_lang=en', 'data.target_lang=de']),
}


@pytest.fixture(scope='module', params=sorted(MODELS))
def setup(request, tmp_path_factory, process_environment):
  """An imported model, TSV splits and the subprocesses' environment
  (2 devices, the test run's compilation cache)."""
  root = tmp_path_factory.mktemp('finetune')
  folder, export = str(root / request.param), str(root / 'imported')
  write_folder, model_overrides = MODELS[request.param]
  write_folder(folder)
  assert cli.main(['import', '--from', folder, '--out', export]) == 0
  sources = marian_folders.sentences(marian_folders.WORDS, 60, 1)
  targets = marian_folders.sentences(marian_folders.FOREIGN, 60, 2)
  for split, part in (('train', slice(0, 40)), ('dev', slice(40, 50)),
                      ('test', slice(50, 60))):
    (root / f'{split}.tsv').write_text(''.join(
        f'{s}\t{t}\n' for s, t in zip(sources[part], targets[part])))
  overrides = [
      f'init.pretrained={export}', f'data.tsv.train={root}/train.tsv',
      f'data.tsv.dev={root}/dev.tsv', f'data.tsv.test={root}/test.tsv',
      f'train.num_steps={NUM_STEPS}', 'train.warmup_steps=2',
      'train.log_every=1', 'train.peak_flops=1e9', 'checkpoint.every=2',
      'eval.every=0', 'eval.final_split=', 'eval.bleu_examples=0',
      'eval.num_batches=1', 'data.batching=pack', 'data.batch_size=8',
      'data.max_source_length=32', 'data.max_target_length=32',
      *model_overrides]
  return export, [f'--config.{o}' for o in overrides], process_environment


def train(workdir: pathlib.Path, setup) -> subprocess.Popen:
  _, overrides, environment = setup
  return train_process(workdir, CONFIG, overrides, environment)


output = process_output


def steps_done(workdir: pathlib.Path) -> tuple[list[int], list[int]]:
  """(logged steps, checkpointed steps) so far."""
  logged = []
  if (workdir / 'metrics.jsonl').exists():
    for line in (workdir / 'metrics.jsonl').read_text().splitlines():
      try:
        logged.append(json.loads(line)['step'])
      except json.JSONDecodeError:
        pass  # Being written.
  directory = workdir / 'checkpoints'
  saved = sorted(int(p.name) for p in directory.iterdir()
                 if p.name.isdigit()) if directory.is_dir() else []
  return logged, saved


def numbers(workdir: pathlib.Path) -> list[dict]:
  return [{k: v for k, v in r.items() if k not in TIMING_KEYS}
          for r in read_metrics(str(workdir))]


@pytest.mark.slow
def test_a_killed_finetuning_run_resumes_bitwise(tmp_path, setup):
  reference = tmp_path / 'reference'
  assert train(reference, setup).wait(600) == 0, output(reference)
  assert 'Starting from the parameters of' in output(reference)

  workdir = tmp_path / 'killed'
  killed = train(workdir, setup)
  deadline = time.monotonic() + 600
  while True:
    logged, saved = steps_done(workdir)
    if saved and logged and max(logged) >= 4:
      break
    assert killed.poll() is None, output(workdir)
    assert time.monotonic() < deadline, output(workdir)
    time.sleep(0.01)
  killed.send_signal(signal.SIGKILL)
  killed.wait()
  restored = steps_done(workdir)[1][-1]
  assert restored < NUM_STEPS
  assert train(workdir, setup).wait(600) == 0, output(workdir)
  assert f'Resuming from the checkpoint of step {restored}' in output(workdir)

  # Every record, of the killed run and of the resumed one (which repeats
  # the steps after the checkpoint), is the uninterrupted run's of its step.
  expected, got = numbers(reference), numbers(workdir)
  assert all(record in expected for record in got)
  assert all(record in got for record in expected)
  ours, theirs = trained.load(str(workdir)), trained.load(str(reference))
  assert ours.step == theirs.step == NUM_STEPS
  for a, b in zip(*(map(np.asarray, _leaves(m.params))
                    for m in (ours, theirs))):
    np.testing.assert_array_equal(a, b)
  if hasattr(ours.source_tok, 'languages'):  # A many-to-many model's pair.
    assert (ours.source_tok.language, ours.target_tok.language) == (
        'en', 'de')
  pad = ours.model_config.pad_id
  if ours.model_config.zero_pad_embedding:
    assert not np.asarray(
        ours.params['source_embed']['embedding'])[pad].any()
  start = trained.load(setup[0])
  assert not np.array_equal(
      np.asarray(start.params['source_embed']['embedding']),
      np.asarray(ours.params['source_embed']['embedding']))


def _leaves(tree):
  import jax
  return jax.tree.leaves(tree)


@pytest.mark.slow
@pytest.mark.parametrize('setup', ['m2m100'], indirect=True)
def test_an_m2m100_finetune_trains_several_pairs_in_one_run(setup, tmp_path):
  """data.mixture with a pair per source: en->de (the run's pair, which
  evaluation uses) and en->fr, drawn 1:1."""
  from jaxformer.config.settings import load_config
  from jaxformer.run.trainer import Trainer
  export, overrides, _ = setup
  train_file = str(pathlib.Path(export).parent / 'train.tsv')
  config = load_config(CONFIG, [o[len('--config.'):] for o in overrides]
                       + ['train.num_steps=2', 'checkpoint.every=0'])
  config.data.mixture.sources = [
      dict(name='en-de', source='tsv', tsv=dict(train=train_file)),
      dict(name='en-fr', source='tsv', tsv=dict(train=train_file),
           target_lang='fr')]
  Trainer(config, str(tmp_path)).run()
  drawn = {key: sum(r.get(key, 0) for r in read_metrics(str(tmp_path)))
           for key in ('examples/en-de', 'examples/en-fr')}
  assert all(count > 0 for count in drawn.values()), drawn
