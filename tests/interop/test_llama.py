"""Llama-family folders in and out: `jaxformer import` of Hugging Face
Llama, Qwen2 and Mistral folders computes PyTorch's logits (within 1e-5 in
float32) and continues prompts greedily as `generate(do_sample=False)`
does; `jaxformer export --format hf` gives a folder that
`AutoModelForCausalLM`/`AutoTokenizer.from_pretrained` load, with the same
logits (1e-4) and tokenisation, and that imports again to bitwise the same
parameters; `--format ct2` gives a CTranslate2 Generator whose greedy ids
equal Hugging Face's (float32), and an int8 one that runs. A fine-tune's
prompt/response loss equals Hugging Face's on the same pair.

The folders (llama_folders.py) are random-weight models in several shapes:
GQA and MQA, llama3 rope scaling, linear and none, tied and untied heads,
Qwen2's q/k/v biases and Llama's biases everywhere, head_dim !=
hidden/heads, saved in shards and in bfloat16.
"""
import json
import os

import jax
import numpy as np
import pytest

torch = pytest.importorskip('torch')
transformers = pytest.importorskip('transformers')
pytest.importorskip('safetensors')
pytest.importorskip('tokenizers')

import hf_tokenizer_folders  # noqa: E402
import llama_folders  # noqa: E402

from jaxformer.checkpoints import trained  # noqa: E402
from jaxformer.cli import main as cli  # noqa: E402
from jaxformer.interop import hf_llama  # noqa: E402

NEW_TOKENS = 12


class Imported:
  """A folder, its import, Hugging Face's model and ours."""

  def __init__(self, root, name):
    self.name = name
    self.folder = str(root / name)
    self.out = str(root / f'{name}-jaxformer')
    self.facts = llama_folders.write_folder(self.folder, name)
    assert cli.main(['import', '--from', self.folder, '--out', self.out]) == 0
    self.ours = trained.load(self.out)
    self.config = self.ours.model_config
    self.tokenizer = self.ours.target_tok
    self.hf = llama_folders.hf_model(self.folder)
    self.prompts = llama_folders.prompts(self.tokenizer)
    self.eos_ids = list(self.tokenizer.eos_ids)
    self.greedy = [llama_folders.up_to_eos(
        llama_folders.hf_greedy(self.hf, p, NEW_TOKENS), self.eos_ids)
        for p in self.prompts]

  def rows(self, seed=0) -> np.ndarray:
    return np.random.RandomState(seed).randint(
        0, self.config.vocab_size, (3, 14))


_IMPORTS = {}  # One import per shape for the module, whichever test asks.


@pytest.fixture(scope='module', params=sorted(llama_folders.SHAPES))
def imported(request, tmp_path_factory):
  if request.param not in _IMPORTS:
    _IMPORTS[request.param] = Imported(tmp_path_factory.mktemp('llama'),
                                       request.param)
  return _IMPORTS[request.param]


def shapes_where(test) -> list[str]:
  """The shapes whose (config arguments, how saved) pass `test`."""
  return [name for name, (_, _, arguments, saved) in sorted(
      llama_folders.SHAPES.items()) if test(arguments, saved)]


def test_the_import_has_the_folders_options(imported):
  config, hf = imported.config, imported.facts['config']
  assert (config.num_heads, config.kv_heads, config.head_features) == (
      hf.num_attention_heads, hf.num_key_value_heads,
      getattr(hf, 'head_dim', None) or hf.hidden_size // hf.num_attention_heads)
  assert config.share_embeddings == ('all' if hf.tie_word_embeddings
                                     else 'none')
  assert config.qkv_bias == (hf.model_type == 'qwen2')
  assert config.use_bias == bool(getattr(hf, 'attention_bias', False))
  assert config.rope_scaling == {'default': 'none'}.get(
      hf.rope_parameters['rope_type'], hf.rope_parameters['rope_type'])
  assert config.rope_theta == hf.rope_parameters['rope_theta']
  assert (config.eos_id, config.pad_id) == (
      imported.tokenizer.eos_id, imported.facts['tokenizer']['pad_id'])
  assert imported.ours.task.name == 'language_model'
  assert config.dtype == 'float32'
  assert all(leaf.dtype == np.float32
             for leaf in jax.tree.leaves(imported.ours.params))


def test_logits_equal_pytorchs_within_1e_5(imported):
  rows = imported.rows()
  theirs = llama_folders.hf_logits(imported.hf, rows)
  ours = llama_folders.our_logits(imported.ours.params, imported.config, rows)
  difference = np.abs(ours - theirs).max()
  print(f'{imported.name}: max abs logit difference {difference:.3g} '
        f'(|logits| up to {np.abs(theirs).max():.3g})')
  assert difference < 1e-5


@pytest.mark.slow
def test_greedy_ids_equal_generate(imported):
  ours = llama_folders.our_greedy(imported.ours.params, imported.config,
                                  imported.prompts, NEW_TOKENS,
                                  imported.eos_ids)
  assert ours == imported.greedy
  assert len(set(map(tuple, ours))) > 3  # Not one token over and over.


@pytest.mark.slow
def test_the_generate_command_gives_hugging_faces_greedy_ids(
    imported, tmp_path, capsys):
  """`jaxformer generate --jsonl --temperature 0` on the import: one batch of
  prompts of different lengths, each continued as `generate(do_sample=
  False)` continues the ids Hugging Face's tokenizer makes of it."""
  texts = [t[:12 + 9 * i] for i, t in enumerate(
      hf_tokenizer_folders.training_texts(6, 3))]
  (tmp_path / 'prompts.txt').write_text('\n'.join(texts) + '\n')
  assert cli.main(['generate', '--workdir', imported.out, '--input',
                   str(tmp_path / 'prompts.txt'), '--temperature', '0',
                   '--max-new-tokens', str(NEW_TOKENS), '--jsonl']) == 0
  lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
  hf_tok = transformers.AutoTokenizer.from_pretrained(imported.folder)
  assert [line['prompt'] for line in lines] == texts
  for line, text in zip(lines, texts):
    prompt = hf_tok(text)['input_ids']
    want = llama_folders.up_to_eos(
        llama_folders.hf_greedy(imported.hf, prompt, NEW_TOKENS),
        imported.eos_ids)
    assert line['ids'] == want, text


def test_the_tokenizer_travels_in_the_export(imported):
  hf_tok = transformers.AutoTokenizer.from_pretrained(imported.folder)
  texts = hf_tokenizer_folders.sentences(40)
  assert imported.tokenizer.encode(texts) == hf_tok(texts)['input_ids']


@pytest.mark.slow
@pytest.mark.parametrize(
    'imported', shapes_where(lambda _, saved: saved.get('bf16')),
    indirect=True)
def test_bfloat16_weights_import_exactly_as_float32(imported):
  theirs = imported.hf.state_dict()['model.embed_tokens.weight'].numpy()
  ours = np.asarray(imported.ours.params['embed']['embedding'])
  np.testing.assert_array_equal(ours, theirs)  # Widened from bfloat16.


# ---------------------------------------------------------------- export ---

@pytest.fixture(scope='module')
def exported(imported, tmp_path_factory):
  """The import exported as a Hugging Face folder (by the command)."""
  out = str(tmp_path_factory.mktemp('hf') / 'hf')
  assert cli.main(['export', '--format', 'hf', '--from', imported.out,
                   '--out', out]) == 0
  return out


def test_the_hf_export_loads_with_the_same_logits_and_tokenizer(
    imported, exported):
  config = json.load(open(os.path.join(exported, 'config.json')))
  kind = 'qwen2' if imported.config.qkv_bias else 'llama'
  assert config['model_type'] == kind
  assert config['architectures'] == [
      {'qwen2': 'Qwen2ForCausalLM', 'llama': 'LlamaForCausalLM'}[kind]]
  generation = json.load(open(os.path.join(exported,
                                           'generation_config.json')))
  eos = generation['eos_token_id']
  assert (eos if isinstance(eos, list) else [eos]) == imported.eos_ids
  hf = llama_folders.hf_model(exported)
  rows = imported.rows(seed=1)
  ours = llama_folders.our_logits(imported.ours.params, imported.config, rows)
  assert np.abs(llama_folders.hf_logits(hf, rows) - ours).max() < 1e-4
  texts = hf_tokenizer_folders.sentences(40)
  assert (transformers.AutoTokenizer.from_pretrained(exported)(texts)
          ['input_ids'] == transformers.AutoTokenizer.from_pretrained(
              imported.folder)(texts)['input_ids'])


def test_import_export_import_is_bitwise(imported, exported, tmp_path):
  again = str(tmp_path / 'again')
  assert cli.main(['import', '--from', exported, '--out', again]) == 0
  model = trained.load(again)
  assert model.model_config == imported.config
  jax.tree.map(np.testing.assert_array_equal, model.params,
               imported.ours.params)
  again, first = model.target_tok, imported.tokenizer
  texts = hf_tokenizer_folders.sentences(100)
  assert again.encode(texts) == first.encode(texts)
  rows = np.random.RandomState(3).randint(0, first.vocab_size, (20, 16))
  assert again.decode_batch(rows) == first.decode_batch(rows)
  for name in ('eos_ids', 'eos_id', 'bos_id', 'pad_id', 'unk_id',
               'vocab_size', 'clean_up'):
    assert getattr(again, name) == getattr(first, name), name


def test_ct2_generator_greedy_equals_generate_and_int8_runs(
    imported, tmp_path):
  ctranslate2 = pytest.importorskip('ctranslate2')
  pieces = [[imported.tokenizer.id_to_piece(i) for i in prompt]
            for prompt in imported.prompts]
  for quantization in ('float32', 'int8'):
    out = str(tmp_path / quantization)
    assert cli.main(['export', '--format', 'ct2', '--from', imported.out,
                     '--out', out] + (['--quantization', 'int8']
                                      if quantization == 'int8' else [])) == 0
    generator = ctranslate2.Generator(out, compute_type=quantization,
                                      intra_threads=1)
    results = generator.generate_batch(
        pieces, max_length=NEW_TOKENS, sampling_topk=1,
        include_prompt_in_result=False, end_token=imported.eos_ids,
        return_end_token=True)
    ids = [llama_folders.up_to_eos(r.sequences_ids[0], imported.eos_ids)
           for r in results]
    if quantization == 'float32':
      assert ids == imported.greedy
    else:
      equal = sum(a == b for a, b in zip(ids, imported.greedy))
      print(f'{imported.name}: int8 greedy equal for {equal} of {len(ids)}')
      assert all(1 <= len(row) <= NEW_TOKENS for row in ids)
  assert {'tokenizer.json', 'generation_config.json', 'model.bin'} <= set(
      os.listdir(str(tmp_path / 'int8')))


@pytest.mark.slow
def test_a_prompt_response_loss_equals_hugging_faces(imported):
  """The loss `configs/finetune_lm.py:tsv` trains on, of each pair, is
  Hugging Face's: the model reads BOS (where its tokenizer adds one) +
  prompt + response + EOS, and the loss falls on the response and EOS
  (labels -100 on the prompt). For Qwen2, without BOS, this holds only if
  the row starts with the prompt's first token, not a start token."""
  import ml_collections
  from jaxformer.data import lm_rows
  from jaxformer.train.tasks import get_task
  texts = hf_tokenizer_folders.training_texts(8, seed=5)
  prompts, responses = texts[:4], texts[4:]
  rows = lm_rows.language_model_rows(
      ml_collections.ConfigDict(dict(lm_rows='prompt_response',
                                     max_target_length=48)),
      prompts, responses, 'train', imported.tokenizer)
  task = get_task('language_model')
  hf_tok = transformers.AutoTokenizer.from_pretrained(imported.folder)
  for row, (prompt, response) in enumerate(zip(prompts, responses)):
    batch = {key: value[row:row + 1] for key, value in rows.items()}
    sums = task.loss_sums(task.model(imported.config), imported.ours.params,
                          batch, {}, 0.0)
    ours = float(sums['loss'] / sums['weight'])
    context = hf_tok(prompt).input_ids
    if context[-1:] == [hf_tok.eos_token_id]:
      context = context[:-1]  # A tokenizer that ends every text with EOS.
    answer = hf_tok(response, add_special_tokens=False).input_ids + [
        imported.tokenizer.eos_id]
    ids = torch.tensor([context + answer])
    labels = torch.tensor([[-100] * len(context) + answer])
    with torch.no_grad():
      theirs = float(imported.hf(input_ids=ids, labels=labels).loss)
    assert abs(ours - theirs) < 1e-5, (imported.name, row, ours, theirs)


@pytest.mark.slow
@pytest.mark.parametrize('imported', shapes_where(
    lambda arguments, _: arguments.get('rope_parameters', {}).get(
        'rope_type') == 'llama3'), indirect=True)
def test_llama3_scaling_changes_what_the_tests_compare(imported):
  """Without the llama3 factor the greedy ids differ: the equalities
  above hold only with the scaling written and read."""
  unscaled = imported.config.replace(rope_scaling_factor=1.0)
  assert llama_folders.our_greedy(
      imported.ours.params, unscaled, imported.prompts, NEW_TOKENS,
      imported.eos_ids) != imported.greedy


@pytest.mark.parametrize('imported', sorted(llama_folders.SHAPES)[:1],
                         indirect=True)
def test_a_sharded_export_loads(imported, tmp_path):
  out = hf_llama.export(imported.ours, str(tmp_path / 'sharded'),
                        max_shard_bytes=30_000)
  assert 'model.safetensors.index.json' in os.listdir(out)
  assert len([n for n in os.listdir(out) if n.startswith('model-')]) > 1
  hf = llama_folders.hf_model(out)
  rows = imported.rows(seed=2)
  ours = llama_folders.our_logits(imported.ours.params, imported.config, rows)
  assert np.abs(llama_folders.hf_logits(hf, rows) - ours).max() < 1e-4
