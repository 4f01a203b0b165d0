"""LoRA fine-tuning through `jaxformer train` (model.lora on a language
model export): the loss falls, the export's weights come out bitwise as
they went in, the adapters moved; a SIGKILLed LoRA run resumes bitwise."""
import jax
import numpy as np
import pytest
from flax import traverse_util

from jaxformer.checkpoints import trained
from jaxformer.config.settings import load_config
from jaxformer.model import lora
from jaxformer.run.metrics import read_metrics
from jaxformer.run.trainer import Trainer
from test_fault_tolerance import kill_resume_and_compare
from test_finetune_lm import CONFIG, _overrides, setup  # noqa: F401
from trained_runs import process_output, train_process

LORA = ['model.lora.targets=q,v,o,ffn_in', 'model.lora.rank=4',
        'model.lora.alpha=8']


def _flat(params):
  return traverse_util.flatten_dict(jax.tree.map(np.asarray, params))


@pytest.mark.slow
def test_a_lora_finetune_trains_the_adapters_alone(setup, tmp_path):
  root, exports = setup
  config = load_config(f'{CONFIG}:tsv',
                       _overrides(root, exports['own'], 'tsv', 8) + LORA)
  Trainer(config, str(tmp_path)).run()
  losses = [r['loss'] for r in read_metrics(str(tmp_path)) if 'loss' in r]
  assert losses[-1] < losses[0], losses
  start, tuned = _flat(trained.load(exports['own']).params), _flat(
      trained.load(str(tmp_path)).params)
  adapters = {path for path in tuned if lora.is_adapter(path)}
  assert adapters and set(tuned) - adapters == set(start)
  for path in start:
    assert tuned[path].tobytes() == start[path].tobytes(), path
  assert all(np.abs(tuned[p]).max() > 0 for p in adapters
             if p[-1] == 'lora_b')


@pytest.mark.slow
def test_an_nf4_base_is_the_exports_kernels_quantized_and_stays_so(
    setup, tmp_path):
  from jaxformer.model import frozen_kernels
  root, exports = setup
  config = load_config(f'{CONFIG}:tsv', _overrides(
      root, exports['own'], 'tsv', 8) + LORA + ['model.lora.base_dtype=nf4'])
  Trainer(config, str(tmp_path)).run()
  losses = [r['loss'] for r in read_metrics(str(tmp_path)) if 'loss' in r]
  assert losses[-1] < losses[0], losses
  start, tuned = _flat(trained.load(exports['own']).params), _flat(
      trained.load(str(tmp_path)).params)
  packed = [path for path in tuned if path[-1] == frozen_kernels.SCALE]
  assert packed
  for scale in packed:
    kernel = scale[:-1] + ('kernel',)
    # The scales are blocked along the one axis they have fewer of.
    [axis] = [i for i, (k, n) in enumerate(zip(start[kernel].shape,
                                               tuned[scale].shape)) if k != n]
    codes, scales = frozen_kernels.nf4_of(start[kernel], axis + 1)
    assert tuned[kernel].dtype == np.uint8
    assert tuned[kernel].tobytes() == np.asarray(codes).tobytes(), kernel
    assert tuned[scale].tobytes() == np.asarray(scales).tobytes(), scale


@pytest.mark.slow
def test_a_killed_lora_finetune_resumes_bitwise(setup, tmp_path,
                                                process_environment):
  root, exports = setup
  steps = 12
  overrides = _overrides(root, exports['hf'], 'tsv', steps) + LORA
  flags = [f'--config.{o}' for o in overrides]
  kill_resume_and_compare(
      lambda workdir: train_process(workdir, f'{CONFIG}:tsv', flags,
                                    process_environment),
      process_output, tmp_path, steps)


@pytest.mark.slow
def test_a_chat_lora_finetune_of_a_padded_import_trains(tmp_path):
  """configs/finetune_lora.py as docs/finetune-llama.md runs it: a Qwen2
  import whose embedding table is padded past its tokenizer's ids, chat
  JSONL rendered with its template; the base comes out bitwise, the loss
  falls on the assistant's tokens."""
  import json
  import pathlib
  import sys
  sys.path.insert(0, str(pathlib.Path(__file__).parent / 'interop'))
  import llama_folders  # pylint: disable=import-outside-toplevel
  from jaxformer.cli import main as cli
  folder, export = str(tmp_path / 'hf'), str(tmp_path / 'import')
  llama_folders.write_folder(folder, 'qwen2-mqa-tied-bf16')
  assert cli.main(['import', '--from', folder, '--out', export]) == 0
  imported = trained.load(export)
  assert imported.model_config.vocab_size > imported.source_tok.vocab_size
  conversation = {'messages': [
      {'role': 'user', 'content': 'what is two plus two'},
      {'role': 'assistant', 'content': 'four'}]}
  for split in ('train', 'dev'):
    (tmp_path / f'{split}.jsonl').write_text(
        (json.dumps(conversation) + '\n') * 16)
  config = load_config(
      f'{CONFIG.replace("finetune_lm", "finetune_lora")}:1b', [
          f'init.pretrained={export}',
          f'data.text.train={tmp_path}/train.jsonl',
          f'data.text.dev={tmp_path}/dev.jsonl', 'data.batch_size=8',
          'data.max_target_length=64', 'model.max_len=64',
          'model.lora.dropout=0', 'train.num_steps=6', 'train.warmup_steps=1',
          'train.learning_rate=1e-2', 'train.log_every=1',
          'train.peak_flops=1e9', 'eval.every=0'])
  Trainer(config, str(tmp_path / 'run')).run()
  losses = [r['loss'] for r in read_metrics(str(tmp_path / 'run'))
            if 'loss' in r]
  assert losses[-1] < losses[0], losses
  start, tuned = _flat(trained.load(export).params), _flat(
      trained.load(str(tmp_path / 'run')).params)
  for path in start:
    assert tuned[path].tobytes() == start[path].tobytes(), path
