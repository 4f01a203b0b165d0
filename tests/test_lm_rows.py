"""Language model rows (data/lm_rows.py) with jaxformer's tokenizers and
Hugging Face ones: documents end with one EOS; a prompt/response pair is
prompt + response + EOS with the loss mask on the response + EOS, after
the model's start token, or, for a tokenizer without BOS, from the
prompt's first token on (the row's start)."""
import ml_collections
import numpy as np
import pytest

from jaxformer.data import lm_rows
from jaxformer.data import sources
from jaxformer.data import tokenizer as tokenizer_lib

WORDS = ['<unk>', '<s>', '</s>', 'what', 'is', 'two', 'plus', 'four', '?',
         'it', 'six', 'one']


def hf_tokenizer(with_bos: bool):
  """A word-level Hugging Face tokenizer that adds BOS (as Llama's) or
  nothing (as Qwen2's), EOS '</s>', padding with EOS."""
  tokenizers = pytest.importorskip('tokenizers')
  from jaxformer.data.hf_tokenizer import HFTokenizer
  backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(
      {w: i for i, w in enumerate(WORDS)}, unk_token='<unk>'))
  backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  backend.add_special_tokens(['<s>', '</s>'])
  if with_bos:
    backend.post_processor = tokenizers.processors.TemplateProcessing(
        single='<s> $A', special_tokens=[('<s>', 1)])
  return HFTokenizer(backend.to_str(), eos_ids=[2], pad_id=2, eos_id=2,
                     bos_id=1 if with_bos else None, unk_id=0)


@pytest.fixture(scope='module')
def own_tokenizer(tmp_path_factory):
  config = ml_collections.ConfigDict(dict(
      type='bpe', vocab_size=40, character_coverage=1.0))
  texts = ['what is two plus four ?', 'it is six', 'one plus one'] * 50
  return tokenizer_lib.train_tokenizer(
      texts, str(tmp_path_factory.mktemp('spm') / 'joint'), config)


def _data(lm_rows_kind, width=12):
  return ml_collections.ConfigDict(dict(lm_rows=lm_rows_kind,
                                        max_target_length=width))


@pytest.mark.parametrize('with_bos', [True, False])
def test_a_pair_row_is_prompt_response_eos_with_the_mask_on_the_response(
    with_bos):
  tok = hf_tokenizer(with_bos)
  rows = lm_rows.language_model_rows(
      _data('prompt_response'), ['what is two plus four ?', 'one plus one'],
      ['it is six', 'two'], 'train', tok)
  # With a BOS, the model's start token stands for it (-1: the model's);
  # without (Qwen2), the prompt's first token is the row's first input.
  first = [3, 4, 5, 6, 7, 8] + [9, 4, 10, 2]
  second = [11, 6, 11] + [5, 2]
  skip = 0 if with_bos else 1
  assert rows[lm_rows.ROW_START].tolist() == (
      [-1, -1] if with_bos else [3, 11])
  for row, ids, prompt in ((0, first[skip:], 6 - skip),
                           (1, second[skip:], 3 - skip)):
    expected = np.zeros(12, np.int32)
    expected[:len(ids)] = ids
    np.testing.assert_array_equal(rows['targets'][row], expected)
    np.testing.assert_array_equal(rows['targets_segment_ids'][row],
                                  np.arange(12) < len(ids))
    np.testing.assert_array_equal(
        rows['targets_positions'][row],
        np.where(np.arange(12) < len(ids), np.arange(12), 0))
    mask = rows[lm_rows.LOSS_MASK][row]
    np.testing.assert_array_equal(np.flatnonzero(mask),
                                  np.arange(prompt, len(ids)))
  # Cut at the width: the mask stays on the response's first tokens.
  cut = lm_rows.language_model_rows(
      _data('prompt_response', 8), ['what is two plus four ?'], ['it is six'],
      'train', tok)
  np.testing.assert_array_equal(cut['targets'][0], first[skip:8 + skip])
  assert cut[lm_rows.LOSS_MASK][0].tolist() == [0] * (6 - skip) + [1] * (
      2 + skip)


def test_pairs_with_jaxformers_tokenizer_have_one_eos_and_no_bos(
    own_tokenizer):
  prompt, response = own_tokenizer.encode(['what is two', 'it is six'])
  rows = lm_rows.language_model_rows(
      _data('prompt_response', 32), ['what is two'], ['it is six'], 'train',
      own_tokenizer)
  ids = prompt[:-1] + response  # The prompt's EOS goes, the response's stays.
  assert rows['targets'][0, :len(ids)].tolist() == ids
  assert rows['targets'][0, len(ids):].sum() == 0
  assert np.flatnonzero(rows[lm_rows.LOSS_MASK][0]).tolist() == list(
      range(len(prompt) - 1, len(ids)))


@pytest.mark.parametrize('with_bos', [True, False])
def test_documents_end_with_one_eos_whatever_the_tokenizer(with_bos,
                                                           own_tokenizer):
  tok = hf_tokenizer(with_bos)
  assert lm_rows.document_ids(tok, ['it is six', 'one']) == [
      [9, 4, 10, 2], [11, 2]]  # No BOS: the model's start stands for it.
  texts = ['what is two plus four ?', 'it is six']
  # jaxformer's own: the ids encode gives (each ends with EOS), as before.
  assert lm_rows.document_ids(own_tokenizer, texts) == own_tokenizer.encode(
      texts)
  rows = lm_rows.language_model_rows(_data('packed', 4), ['it is six'], [''],
                                     'train', tok)
  assert lm_rows.LOSS_MASK not in rows
  assert rows['targets'].reshape(-1)[:4].tolist() == [9, 4, 10, 2]


def test_pairs_need_a_response_and_a_known_layout():
  tok = hf_tokenizer(True)
  with pytest.raises(sources.DataError, match="dev example 2: no response.*"
                     "prompt<TAB>response"):
    lm_rows.language_model_rows(_data('prompt_response'), ['one', 'two'],
                                ['six', ''], 'dev', tok)
  with pytest.raises(sources.DataError, match="data.lm_rows='pairs'"):
    lm_rows.language_model_rows(_data('pairs'), ['one'], ['six'], 'dev', tok)


def test_every_tokenizer_is_one_interface(own_tokenizer):
  from jaxformer.data import vocab_tokenizer
  from jaxformer.data.language_tokenizer import LanguageTokenizer
  from jaxformer.data.tokenizer_protocol import TokenizerLike
  pieces = [own_tokenizer.id_to_piece(i)
            for i in range(own_tokenizer.vocab_size)]
  pieces[:3] = ['<pad>', '</s>', '<unk>']
  vocab = vocab_tokenizer.VocabTokenizer(own_tokenizer.sentencepiece_model,
                                         pieces)
  language = LanguageTokenizer(own_tokenizer, {'en': 40}, vocab_size=41,
                               language='en')
  hf = hf_tokenizer(with_bos=False)
  for tok in (own_tokenizer, vocab, hf, language):
    assert isinstance(tok, TokenizerLike), type(tok)
  assert [t.first_token_is_input for t in (own_tokenizer, vocab, hf)] == [
      False, False, True]
  assert hf.eos_ids == (2,) and own_tokenizer.eos_ids == vocab.eos_ids == ()
  assert own_tokenizer.hf_files() == {} and 'tokenizer.json' in hf.hf_files()
  ids, types = own_tokenizer.encode_pairs([('one', 'it is six')])[0]
  assert types[0] == 0 and types[-1] == 1 and len(ids) == len(types)
  with pytest.raises(sources.DataError, match='encodes no sentence pairs'):
    language.encode_pairs([('one', 'two')])


@pytest.mark.parametrize('with_bos', [True, False])
def test_cached_pair_rows_of_a_hugging_face_tokenizer_are_those_in_memory(
    tmp_path, with_bos):
  from jaxformer.data import task_batches
  from jaxformer.data.defaults import default_data_config
  tok = hf_tokenizer(with_bos)
  pairs = [('what is two plus four ?', 'it is six'), ('one plus one', 'two'),
           ('what is six', 'six')] * 5
  path = tmp_path / 'chat.tsv'
  path.write_text(''.join(f'{p}\t{r}\n' for p, r in pairs))
  config = ml_collections.ConfigDict(dict(
      task='language_model', model={}, init={}, data=default_data_config()))
  config.data.update(source='tsv', lm_rows='prompt_response',
                     max_target_length=6, token_cache_piece_bytes=64)
  config.data.tsv.train = str(path)
  table = task_batches.task_table(config, 'train', tok, str(tmp_path / 'c'))
  rows = table.take(np.arange(table.num_rows))
  expected = lm_rows.language_model_rows(
      config.data, [p for p, _ in pairs], [r for _, r in pairs], 'train', tok)
  assert sorted(rows) == sorted(expected)
  for key in expected:
    np.testing.assert_array_equal(rows[key], expected[key], err_msg=key)
