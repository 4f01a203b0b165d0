"""PEFT LoRA adapters of the BERT family, M2M100/NLLB and Marian: `jaxformer
import --from BASE --adapter PEFT_DIR` computes PeftModel's logits (within
1e-5; translators: teacher-forced, and greedy ids equal to generate's, with
M2M100's forced_bos_token_id); `export --format peft` gives a folder
`PeftModel.from_pretrained` loads with the same logits, and that imports
again bitwise. Adapters are made by `peft` over random-weight folders
(bert_folders.py, m2m100_folders.py, marian_folders.py), every lora_B drawn
non-zero; a translator's q_proj and v_proj adapt its cross-attention too,
as PEFT's do. A target module the family lacks fails with one line."""
import json
import os

import jax
import numpy as np
import pytest

torch = pytest.importorskip('torch')
pytest.importorskip('transformers')
peft = pytest.importorskip('peft')

import bert_folders  # noqa: E402
import m2m100_folders  # noqa: E402
import marian_folders  # noqa: E402
from marian_folders import up_to_eos  # noqa: E402

from jaxformer.checkpoints import trained  # noqa: E402
from jaxformer.cli import main as cli  # noqa: E402
from jaxformer.inference import search  # noqa: E402

M2M100 = dict(tokenizer='m2m100', encoder_layers=2, decoder_layers=1,
              eos_boost=1.7, seed=1)
# name -> (family, base shape, LoraConfig arguments).
ADAPTERS = {
    'bert-qv-r4': ('bert', 'bert-cls2-vocab-txt', dict(
        r=4, lora_alpha=8, target_modules=['query', 'value'])),
    'roberta-all-r4-rslora': ('bert', 'roberta-regression-bpe', dict(
        r=4, lora_alpha=8, use_rslora=True, target_modules=[
            'query', 'key', 'value', 'attention.output.dense',
            'intermediate.dense', 'output.dense'])),
    'm2m100-qv-fc1-r4': ('m2m100', M2M100, dict(
        r=4, lora_alpha=8, target_modules=['q_proj', 'v_proj', 'fc1'])),
    'm2m100-ko-fc2-r4': ('m2m100', M2M100, dict(
        r=4, lora_alpha=8, target_modules=['k_proj', 'out_proj', 'fc2'])),
    'marian-shared-qv-fc1-r8': ('marian', dict(
        separate=False, activation='swish', scale_embedding=True,
        encoder_layers=2, decoder_layers=1, seed=1), dict(
            r=8, lora_alpha=16, target_modules=['q_proj', 'v_proj', 'fc1'])),
    'marian-separate-all-r4-rslora': ('marian', dict(
        separate=True, activation='gelu', scale_embedding=False,
        encoder_layers=1, decoder_layers=2, seed=2), dict(
            r=4, lora_alpha=8, use_rslora=True, target_modules=[
                'q_proj', 'k_proj', 'v_proj', 'out_proj', 'fc1', 'fc2'])),
}
TRANSLATORS = ('m2m100', 'marian')
SOURCE, TARGET = 'en', 'de'


def base_model(family: str, folder: str, shape):
  if family == 'bert':
    return bert_folders.hf_model(folder, shape)
  if family == 'marian':
    from transformers import MarianMTModel
    return MarianMTModel.from_pretrained(folder).eval()
  from transformers import M2M100ForConditionalGeneration
  return M2M100ForConditionalGeneration.from_pretrained(folder).eval()


def write_adapter(base, folder: str, arguments: dict, seed=0):
  """A PEFT LoRA adapter over `base`, every lora_B drawn non-zero, saved
  by save_pretrained; returns the PeftModel (float32, eval)."""
  model = peft.get_peft_model(base, peft.LoraConfig(lora_dropout=0.0,
                                                    **arguments))
  generator = torch.Generator().manual_seed(seed)
  scale = arguments['lora_alpha'] / (arguments['r'] ** 0.5 if arguments.get(
      'use_rslora') else arguments['r'])
  with torch.no_grad():
    for name, tensor in model.named_parameters():
      if 'lora_B' in name:
        tensor.copy_(0.4 / scale * torch.randn(tensor.shape,
                                               generator=generator))
  model.save_pretrained(folder)
  return model.eval()


class Adapted:
  """A base folder, a PEFT adapter over it, PEFT's model and our import."""

  def __init__(self, root, name):
    self.family, self.shape, self.arguments = ADAPTERS[name]
    self.base = str(root / 'base')
    self.adapter = str(root / 'adapter')
    self.out = str(root / 'jaxformer')
    if self.family == 'bert':
      bert_folders.write_folder(self.base, self.shape)
    elif self.family == 'marian':
      marian_folders.write_folder(self.base, **self.shape)
    else:
      m2m100_folders.write_folder(self.base, **self.shape)
    self.peft_model = write_adapter(self.base_model(), self.adapter,
                                    self.arguments)
    assert cli.main(['import', '--from', self.base, '--adapter',
                     self.adapter, '--out', self.out]) == 0
    self.ours = trained.load(self.out)
    self.config = self.ours.model_config

  def base_model(self):
    return base_model(self.family, self.base, self.shape)

  def inputs(self):
    """BERT: (ids, token types) of sentence pairs; translators: (sources,
    targets) token rows, padded."""
    if self.family == 'bert':
      texts = marian_folders.sentences(marian_folders.WORDS, 8, 5)
      encoded = [self.ours.source_tok.encode_pair(a, b if i % 2 else None)
                 for i, (a, b) in enumerate(zip(texts[::2], texts[1::2]))]
      pad = self.config.pad_id
      return (bert_folders.pad_rows([ids for ids, _ in encoded], pad),
              bert_folders.pad_rows([types for _, types in encoded], 0))
    if self.family == 'marian':
      return [bert_folders.pad_rows(
          [list(r) for r in tok.encode(marian_folders.test_texts(8, seed))],
          self.config.pad_id)
              for tok, seed in ((self.ours.source_tok, 5),
                                (self.ours.target_tok, 9))]
    tok = m2m100_folders.hf_tokenizer(self.base)
    rows = []
    for language, seed in ((SOURCE, 5), (TARGET, 9)):
      tok.src_lang = language
      ids = [tok(t)['input_ids'] for t in m2m100_folders.test_texts(8, seed)]
      rows.append(bert_folders.pad_rows(ids, self.config.pad_id))
    return rows

  def theirs(self, model, inputs) -> np.ndarray:
    if self.family == 'bert':
      return bert_folders.hf_outputs(model, *inputs, self.config.pad_id)
    sources, targets = inputs
    pad = self.config.pad_id
    with torch.no_grad():
      return model(input_ids=torch.tensor(sources),
                   attention_mask=torch.tensor(sources != pad),
                   labels=torch.tensor(np.where(targets == pad, -100, targets))
                   ).logits.numpy()

  def mine(self, params, inputs) -> np.ndarray:
    from jaxformer.model import EncoderDecoder
    if self.family == 'bert':
      ids, types = inputs
      return np.asarray(self.ours.task.model(self.config).apply(
          {'params': params}, ids, (ids != self.config.pad_id).astype(
              np.int32), inputs_token_types=types))
    return np.asarray(EncoderDecoder(self.config).apply(
        {'params': params}, *inputs))

  def difference(self, model, params) -> float:
    inputs = self.inputs()
    real = (slice(None) if self.family == 'bert' else
            inputs[1] != self.config.pad_id)
    return float(np.abs(self.theirs(model, inputs) - self.mine(
        params, inputs))[real].max())


_ADAPTED = {}


def adapted_of(name: str, tmp_path_factory) -> Adapted:
  """One import per adapter for the module, whichever test asks."""
  if name not in _ADAPTED:
    _ADAPTED[name] = Adapted(tmp_path_factory.mktemp('peft'), name)
  return _ADAPTED[name]


@pytest.fixture(scope='module', params=sorted(ADAPTERS))
def adapted(request, tmp_path_factory):
  return adapted_of(request.param, tmp_path_factory)


def test_the_import_has_the_adapters_settings(adapted):
  arguments, lora = adapted.arguments, adapted.config.lora
  assert (lora.rank, lora.alpha, lora.use_rslora) == (
      arguments['r'], arguments['lora_alpha'],
      arguments.get('use_rslora', False))
  assert len(adapted.config.lora_targets) == len(arguments['target_modules'])


@pytest.mark.slow
def test_logits_equal_peft_within_1e_5(adapted):
  base = adapted.base_model()
  moved = np.abs(adapted.theirs(adapted.peft_model, adapted.inputs())
                 - adapted.theirs(base, adapted.inputs())).max()
  difference = adapted.difference(adapted.peft_model, adapted.ours.params)
  print(f'{adapted.adapter}: max abs logit difference {difference:.3g}, '
        f'the adapter moves them by {moved:.3g}')
  assert moved > 1e-2  # The adapter counts.
  assert difference < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize('name', [name for name, (family, _, _)
                                  in sorted(ADAPTERS.items())
                                  if family in TRANSLATORS])
def test_translator_greedy_ids_equal_peft_generate(name, tmp_path_factory):
  adapted = adapted_of(name, tmp_path_factory)
  sources, _ = adapted.inputs()
  forced = (adapted.ours.source_tok.language_id(TARGET)
            if adapted.family == 'm2m100' else None)
  pad, eos = adapted.config.pad_id, adapted.config.eos_id
  settings = (dict(forced_bos_token_id=forced) if forced is not None
              else dict(forced_eos_token_id=None))
  with torch.no_grad():
    theirs = adapted.peft_model.generate(
        input_ids=torch.tensor(sources), do_sample=False, num_beams=1,
        attention_mask=torch.tensor(sources != pad), max_new_tokens=16,
        **settings).numpy()[:, 1:]
  ours = np.asarray(search.greedy_decode(
      adapted.ours.params, adapted.config, sources, max_decode_len=16,
      forced_ids=forced))
  assert [up_to_eos(r, eos) for r in ours] == [up_to_eos(r, eos)
                                               for r in theirs]


@pytest.mark.slow
def test_peft_export_loads_in_peft_and_imports_again_bitwise(adapted,
                                                             tmp_path):
  out = str(tmp_path / 'peft')
  assert cli.main(['export', '--format', 'peft', '--from', adapted.out,
                   '--out', out]) == 0
  assert sorted(os.listdir(out)) == ['adapter_config.json',
                                     'adapter_model.safetensors']
  loaded = peft.PeftModel.from_pretrained(adapted.base_model(), out).eval()
  assert adapted.difference(loaded, adapted.ours.params) < 1e-5
  again = str(tmp_path / 'again')
  assert cli.main(['import', '--from', adapted.base, '--adapter', out,
                   '--out', again]) == 0
  model = trained.load(again)
  assert model.model_config == adapted.config
  jax.tree.map(np.testing.assert_array_equal, model.params,
               adapted.ours.params)


@pytest.mark.parametrize('target, has', [
    ('fc1', 'query (q), key (k), value (v), attention.output.dense (o), '
     'intermediate.dense (ffn_in)'),
    ('dense', 'bert.pooler.dense, which is no projection')])
def test_bert_targets_it_lacks_are_refused_naming_those_it_has(
    tmp_path_factory, tmp_path, capsys, target, has):
  bert = adapted_of('bert-qv-r4', tmp_path_factory)
  folder = tmp_path / 'bad'
  folder.mkdir()
  settings = json.load(open(os.path.join(bert.adapter,
                                         'adapter_config.json')))
  settings['target_modules'] = ['query', target]
  (folder / 'adapter_config.json').write_text(json.dumps(settings))
  (folder / 'adapter_model.safetensors').write_bytes(open(os.path.join(
      bert.adapter, 'adapter_model.safetensors'), 'rb').read())
  out = tmp_path / 'out'
  capsys.readouterr()
  assert cli.main(['import', '--from', bert.base, '--adapter', str(folder),
                   '--out', str(out)]) == 1
  lines = capsys.readouterr().err.strip().splitlines()
  assert len(lines) == 1, lines
  assert has in lines[0], lines[0]
  assert not out.exists()
