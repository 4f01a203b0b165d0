"""`generate` with a Hugging Face tokenizer (data/hf_tokenizer.py): the
model is fed the ids AutoTokenizer gives (BOS where it adds one, no
decoder start), rows end at any of the tokenizer's EOS ids, and the text is
AutoTokenizer's decode of the new ids. The models are random native
decoders whose vocabulary is the tokenizer's (hf_tokenizer_folders.py)."""
import json

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

pytest.importorskip('transformers')
pytest.importorskip('tokenizers')

import hf_tokenizer_folders as folders  # noqa: E402

from jaxformer.data import hf_tokenizer  # noqa: E402
from jaxformer.inference import generation, predict  # noqa: E402
from jaxformer.interop import hf_folders  # noqa: E402
from jaxformer.model import DecoderLM, ModelConfig  # noqa: E402

PROMPTS = ['the house is', '', 'she reads books every', 'a cat']
NEW = 6


class Model:
  """A folder's tokenizer (ours and AutoTokenizer) and a random Llama-style
  decoder over its ids."""

  def __init__(self, root, name):
    from transformers import AutoTokenizer
    path = str(root / name)
    folders.FOLDERS[name](path)
    self.tok = hf_folders.load_tokenizer(path)
    self.hf = AutoTokenizer.from_pretrained(path)
    self.config = ModelConfig(
        vocab_size=self.tok.vocab_size, d_model=16, num_heads=4,
        num_kv_heads=2, d_ff=32, num_decoder_layers=2, max_len=32,
        position_embedding='rope', norm_type='rms', norm_position='pre',
        activation='swiglu', use_bias=False, share_embeddings='none',
        logits_bias=False, pad_id=self.tok.pad_id, eos_id=self.tok.eos_id)
    self.params = DecoderLM(self.config).init(
        jax.random.PRNGKey(0), jnp.ones((1, 4), jnp.int32))['params']
    self.run = ml_collections.ConfigDict({'task': 'language_model'})

  def generate(self, tok, **kwargs):
    return list(predict.generate_lines(
        self.params, self.config, self.run, tok, PROMPTS,
        max_new_tokens=NEW, temperature=0.0, **kwargs))


@pytest.fixture(scope='module', params=['llama3-bytelevel', 'qwen2-bytelevel'])
def model(request, tmp_path_factory):
  return Model(tmp_path_factory.mktemp('hf'), request.param)


@pytest.mark.slow
def test_prompts_are_fed_as_autotokenizer_encodes_them(model):
  outputs = model.generate(model.tok, batch_size=3)
  inputs = [model.hf(p)['input_ids'] for p in PROMPTS]
  assert [o.ids for o in outputs] == [
      generation.generate_ids(model.params, model.config, [ids],
                              max_new_tokens=NEW,
                              eos_ids=model.tok.eos_ids)[0] for ids in inputs]
  # An empty prompt has no input where the tokenizer adds no BOS (Qwen2).
  assert (outputs[1].ids == []) == (model.tok.bos_id is None)
  assert [o.text for o in outputs] == [
      model.hf.decode(o.ids, skip_special_tokens=True) for o in outputs]
  assert [o.prompt for o in outputs] == PROMPTS


@pytest.mark.slow
def test_rows_end_at_any_of_the_tokenizers_eos_ids(model):
  free = [o.ids for o in model.generate(model.tok)]
  eos_ids = [free[0][1], free[2][2]]
  fields = json.loads(model.tok.serialized_model_proto())
  fields['eos_ids'] = eos_ids
  ending = hf_tokenizer.HFTokenizer.from_serialized(
      json.dumps(fields).encode())
  ended = [o.ids for o in model.generate(ending)]
  assert ended == [generation.until_end(ids, eos_ids) for ids in free]
  assert len(ended[0]) <= 2 and len(ended[2]) <= 3
  assert np.all([ids[-1] in eos_ids for ids in ended[::2]])
