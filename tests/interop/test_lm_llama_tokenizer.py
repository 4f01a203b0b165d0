"""configs/lm_llama.py with a Hugging Face tokenizer instead of one
trained for the run: a Llama 3 style byte-level BPE (hf_tokenizer_folders.py)
saved as a run keeps it, given as data.tokenizer.model_path."""
import math

import pytest

pytest.importorskip('transformers')
pytest.importorskip('tokenizers')

import hf_tokenizer_folders as folders  # noqa: E402

from jaxformer.config import settings  # noqa: E402
from jaxformer.interop import hf_folders  # noqa: E402


@pytest.mark.slow  # The tokenizer, a compile and 3 steps: ~20 s of CPU.
def test_tiny_trains_with_a_llama3_tokenizer(tmp_path):
  from jaxformer.run.trainer import Trainer
  folder = tmp_path / 'llama3'
  folder.mkdir()
  ids = folders.write_llama3(str(folder))
  tokenizer = hf_folders.load_tokenizer(str(folder))
  path = tmp_path / 'joint.model'
  path.write_bytes(tokenizer.serialized_model_proto())
  config = settings.load_config('configs/lm_llama.py:tiny', [
      f'data.tokenizer.model_path={path}',
      f'data.tokenizer.vocab_size={tokenizer.vocab_size}',
      f'model.vocab_size={tokenizer.vocab_size}',
      f'model.decoder_start_id={ids["bos_id"]}', 'train.num_steps=3',
      'checkpoint.every=3'])
  trainer = Trainer(config, str(tmp_path / 'run'))
  metrics = trainer.run()
  assert int(trainer.state.step) == 3 and math.isfinite(metrics['loss'])
  model = trainer.spec.config.model
  assert (model.vocab_size, model.pad_id, model.eos_id,
          model.decoder_start_id) == (tokenizer.vocab_size, ids['pad_id'],
                                      tokenizer.eos_id, ids['bos_id'])
  kept = tmp_path / 'run' / 'tokenizer' / 'joint.model'
  assert kept.read_bytes() == path.read_bytes()
