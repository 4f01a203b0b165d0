"""configs/finetune_lm.py: a language_model export (with jaxformer's
tokenizer or a Hugging Face one) fine-tuned on plain text (:text) and on
prompt<TAB>response lines (:tsv) with its own tokenizer, on an FSDP mesh;
killed with SIGKILL and resumed, it repeats the uninterrupted run bitwise."""
import pathlib

import pytest

from jaxformer.checkpoints import trained
from jaxformer.config.settings import load_config
from jaxformer.run.metrics import read_metrics
from jaxformer.run.trainer import Trainer
from jaxformer.storage import paths

from test_fault_tolerance import kill_resume_and_compare
from test_lm_rows import WORDS, hf_tokenizer
from trained_runs import NO_PEAK, process_output, train, train_process

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / 'configs' / 'finetune_lm.py')
PAIRS = [('what is two plus four ?', 'it is six'),
         ('one plus one ?', 'it is two'), ('what is six ?', 'six is six')]


def _export(root: pathlib.Path, name: str, *overrides) -> str:
  """A tiny language model trained for 2 steps, exported."""
  workdir = str(root / f'{name}_run')
  assert train(workdir, *(f'--config.{o}' for o in (
      'train.num_steps=2', 'checkpoint.every=0', 'eval.num_batches=1',
      *overrides)), NO_PEAK, config='configs/lm_quick.py:runlocal') == 0
  trained.export(workdir, str(root / name))
  return str(root / name)


@pytest.fixture(scope='module')
def setup(tmp_path_factory):
  """Exports (jaxformer's tokenizer, a Hugging Face one) and data files."""
  root = tmp_path_factory.mktemp('finetune_lm')
  exports = {'own': _export(root, 'own')}
  # A Llama-like tokenizer (adds BOS) and a Qwen2-like one (adds nothing:
  # a prompt/response row then starts with the prompt's first token).
  for name, with_bos in (('hf', True), ('hf_no_bos', False)):
    hf_file = root / f'{name}_tokenizer.json'
    hf_file.write_bytes(hf_tokenizer(with_bos).serialized_model_proto())
    exports[name] = _export(root, name,
                            f'data.tokenizer.model_path={hf_file}',
                            f'data.tokenizer.vocab_size={len(WORDS)}')
  for split in ('train', 'dev'):
    (root / f'{split}.tsv').write_text(''.join(
        f'{p}\t{r}\n' for p, r in PAIRS * 4))
    (root / f'{split}.text').write_text(''.join(
        f'{p} {r}\n' for p, r in PAIRS * 4))
  return root, exports


def _overrides(root, export, kind, steps):
  return [f'init.pretrained={export}', f'data.{kind}.train={root}/train.{kind}',
          f'data.{kind}.dev={root}/dev.{kind}', f'train.num_steps={steps}',
          'train.warmup_steps=1', 'train.learning_rate=1e-2',
          'train.log_every=1', 'train.peak_flops=1e9', 'eval.every=0',
          'eval.num_batches=1', 'data.max_target_length=16',
          'data.batch_size=8', 'checkpoint.every=4', 'checkpoint.keep=10',
          'checkpoint.async_save=False']


@pytest.mark.slow
@pytest.mark.parametrize('kind,tokenizer', [('text', 'own'), ('tsv', 'own'),
                                            ('tsv', 'hf'),
                                            ('tsv', 'hf_no_bos')])
def test_a_finetune_lowers_the_loss_with_the_exports_tokenizer(
    setup, tmp_path, kind, tokenizer):
  root, exports = setup
  config = load_config(f'{CONFIG}:{kind}',
                       _overrides(root, exports[tokenizer], kind, 8))
  trainer = Trainer(config, str(tmp_path))
  trainer.run()
  losses = [r['loss'] for r in read_metrics(str(tmp_path)) if 'loss' in r]
  assert losses[-1] < losses[0], losses
  start, tuned = trained.load(exports[tokenizer]), trained.load(str(tmp_path))
  assert tuned.model_config == start.model_config
  assert (tuned.target_tok.serialized_model_proto()
          == start.target_tok.serialized_model_proto())
  assert not paths.exists(str(tmp_path / 'tokenizer' / 'joint.vocab'))
  assert int(trainer.state.step) == 8


@pytest.mark.slow
def test_a_killed_prompt_response_finetune_resumes_bitwise(
    setup, tmp_path, process_environment):
  root, exports = setup
  steps = 12
  overrides = _overrides(root, exports['hf'], 'tsv', steps)
  flags = [f'--config.{o}' for o in overrides]
  kill_resume_and_compare(
      lambda workdir: train_process(workdir, f'{CONFIG}:tsv', flags,
                                    process_environment),
      process_output, tmp_path, steps)
