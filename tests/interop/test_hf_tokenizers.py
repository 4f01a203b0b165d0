"""The tokenizers of Hugging Face Llama-family folders as jaxformer
tokenizers: equal to `AutoTokenizer` on 300 sentences with unknown
characters and special tokens (encode with BOS/EOS as it adds them, decode
as generation output is read), kept whole through the serialized bytes;
missing or mismatched tokenizers fail with one line.

The folders (hf_tokenizer_folders.py) hold tokenizers trained here: byte-
level BPE (Llama 3 and Qwen2 style) and SentencePiece (Llama 2, Mistral).
"""
import json
import os
import shutil

import numpy as np
import pytest

pytest.importorskip('transformers')
pytest.importorskip('tokenizers')

import hf_tokenizer_folders as folders  # noqa: E402

from jaxformer.data import hf_tokenizer  # noqa: E402
from jaxformer.data import tokenizer as tokenizer_lib  # noqa: E402
from jaxformer.interop import hf_folders  # noqa: E402

SENTENCES = folders.sentences(300)


class Folder:
  """A written folder, HF's AutoTokenizer of it and ours."""

  def __init__(self, root, name):
    from transformers import AutoTokenizer
    self.path = str(root / name)
    self.expected = folders.FOLDERS[name](self.path)
    self.hf = AutoTokenizer.from_pretrained(self.path)
    self.ours = hf_folders.load_tokenizer(self.path)

  def hf_decode(self, ids) -> str:
    """What a reader of `generate` output gets: the ids up to the first
    EOS, padding dropped, decoded with skip_special_tokens=True."""
    ids = list(ids)
    ends = [i for i, t in enumerate(ids) if t in self.expected['eos_ids']]
    ids = ids[:ends[0]] if ends else ids
    return self.hf.decode([t for t in ids if t != self.ours.pad_id],
                          skip_special_tokens=True)


@pytest.fixture(scope='module', params=sorted(folders.FOLDERS))
def folder(request, tmp_path_factory):
  return Folder(tmp_path_factory.mktemp('hf'), request.param)


def test_encode_equals_autotokenizer(folder):
  ours = folder.ours.encode(SENTENCES)
  assert ours == folder.hf(SENTENCES)['input_ids']
  assert ours[:20] == [folder.hf(s)['input_ids'] for s in SENTENCES[:20]]
  bos = folder.expected['bos_id']
  assert all((row[:1] == [bos]) == (bos is not None) for row in ours)
  if folder.hf.add_eos_token:  # The Mistral-style folder.
    assert all(row[-1] == folder.ours.eos_id for row in ours)


def test_special_and_added_tokens_encode_as_one_id(folder):
  for token in folder.expected['chat']:
    token_id = folder.hf.convert_tokens_to_ids(token)
    plain, *with_token = folder.ours.encode(
        ['say hi', f'say{token}hi', f'say {token} hi'])
    assert all(ids.count(token_id) == plain.count(token_id) + 1
               for ids in with_token), (token, with_token)
  assert any(t in s for s in SENTENCES for t in folder.expected['chat'])


def test_special_ids_are_the_folders(folder):
  ours, expected = folder.ours, folder.expected
  assert ours.eos_ids == tuple(expected['eos_ids'])
  assert ours.bos_id == expected['bos_id'] == folder.hf.bos_token_id
  assert ours.eos_id == folder.hf.eos_token_id
  assert ours.pad_id == expected['pad_id']
  assert ours.unk_id == folder.hf.unk_token_id
  assert ours.vocab_size == len(folder.hf)


def random_rows(folder, count=100, seed=0):
  """Id rows over the whole vocabulary, special ids and EOS included, some
  ending in padding."""
  rng = np.random.default_rng(seed)
  rows = rng.integers(0, folder.ours.vocab_size, (count, 24))
  specials = [i for i in (*folder.ours.eos_ids, folder.ours.bos_id,
                          folder.ours.unk_id) if i is not None]
  rows[rng.random(rows.shape) < 0.05] = rng.choice(specials)
  rows[::3, 18:] = folder.ours.pad_id
  return rows


def test_decode_equals_autotokenizer(folder):
  encoded = folder.ours.encode(SENTENCES)
  for ids in encoded + list(random_rows(folder)):
    assert folder.ours.decode(ids) == folder.hf_decode(ids), ids
  rows = random_rows(folder, seed=1)
  assert folder.ours.decode_batch(rows) == [folder.hf_decode(r) for r in rows]


def test_text_round_trips_where_hf_does(folder):
  """Decoding the encoding gives the text back wherever HF's does (byte
  level everywhere but its special tokens; SentencePiece less the space
  it adds)."""
  hf_back = [folder.hf_decode(ids) for ids in folder.hf(SENTENCES)['input_ids']]
  ours_back = [folder.ours.decode(ids) for ids in folder.ours.encode(SENTENCES)]
  assert ours_back == hf_back
  assert sum(a == b for a, b in zip(ours_back, SENTENCES)) >= 100


def test_serialized_bytes_give_the_same_tokenizer(folder):
  data = folder.ours.serialized_model_proto()
  assert hf_tokenizer.is_serialized(data)
  again = tokenizer_lib.from_serialized(data, 'checkpoint')
  assert isinstance(again, hf_tokenizer.HFTokenizer)
  assert again.serialized_model_proto() == data
  assert again.encode(SENTENCES) == folder.ours.encode(SENTENCES)
  rows = random_rows(folder)
  assert again.decode_batch(rows) == folder.ours.decode_batch(rows)
  for name in ('eos_ids', 'eos_id', 'bos_id', 'pad_id', 'unk_id',
               'vocab_size', 'clean_up', 'files'):
    assert getattr(again, name) == getattr(folder.ours, name), name


@pytest.mark.parametrize('model_type', ['folder', 'llama'])
def test_its_files_are_read_back_by_autotokenizer(folder, tmp_path,
                                                  model_type):
  """What an export writes (hf_files) loads in HF as the same tokenizer,
  beside the folder's config.json or an exported Llama's (whose
  LlamaTokenizer would rebuild a Mistral-style tokenizer differently)."""
  from transformers import AutoTokenizer
  shutil.copy(os.path.join(folder.path, 'config.json'), tmp_path)
  if model_type == 'llama':
    (tmp_path / 'config.json').write_text('{"model_type": "llama"}')
  for name, data in folder.ours.hf_files().items():
    (tmp_path / name).write_bytes(data)
  again = AutoTokenizer.from_pretrained(str(tmp_path))
  assert again(SENTENCES)['input_ids'] == folder.ours.encode(SENTENCES)
  rows = random_rows(folder)
  assert [again.decode(r, skip_special_tokens=True) for r in rows] == [
      folder.hf.decode(r, skip_special_tokens=True) for r in rows]


def test_jaxformers_own_kinds_still_load():
  """from_serialized tells the HF kind from a Marian vocabulary's JSON."""
  from jaxformer.data import sources
  with pytest.raises(sources.DataError, match='vocabulary tokenizer'):
    tokenizer_lib.from_serialized(b'{"format": "other"}', 'x')
  with pytest.raises(sources.DataError, match='Hugging Face tokenizer'):
    tokenizer_lib.from_serialized(hf_tokenizer.MARKER + b'}', 'x')


def test_space_cleanup_is_hfs(folder):
  """Where AutoTokenizer cleans up decoded spaces (not for these BPE
  models), it does so as clean_up_spaces does."""
  text = "a , b . c ? d ! e ' f don 't I 'm it 's we 've you 're ."
  assert hf_tokenizer.clean_up_spaces(text) == (
      folder.hf.clean_up_tokenization(text))
  assert not folder.ours.clean_up


# ------------------------------------------------------------ bad folders ---

@pytest.fixture(scope='module')
def good_folder(tmp_path_factory):
  path = tmp_path_factory.mktemp('good') / 'llama3'
  folders.write_llama3(str(path))
  return path


def fails_with_one_line(path, *words):
  with pytest.raises(hf_folders.FolderError) as error:
    hf_folders.load_tokenizer(str(path))
  message = str(error.value)
  assert '\n' not in message, message
  for word in words:
    assert word in message, (word, message)


def test_a_folder_without_a_tokenizer_is_refused(good_folder, tmp_path):
  folder = tmp_path / 'no-tokenizer'
  shutil.copytree(good_folder, folder)
  (folder / 'tokenizer.json').unlink()
  fails_with_one_line(folder, str(folder), 'tokenizer.json', 'tokenizer.model')


def test_a_vocabulary_larger_than_the_models_is_refused(good_folder, tmp_path):
  folder = tmp_path / 'small-model'
  shutil.copytree(good_folder, folder)
  config = json.loads((folder / 'config.json').read_text())
  config['vocab_size'] = 300
  (folder / 'config.json').write_text(json.dumps(config))
  fails_with_one_line(folder, 'tokenizer.json', '412 ids', 'vocab_size=300')


def test_a_damaged_tokenizer_json_is_refused(good_folder, tmp_path):
  folder = tmp_path / 'damaged'
  shutil.copytree(good_folder, folder)
  data = (folder / 'tokenizer.json').read_bytes()
  (folder / 'tokenizer.json').write_bytes(data[:len(data) // 2])
  fails_with_one_line(folder, str(folder / 'tokenizer.json'), 'cannot be read')


def test_an_eos_outside_the_tokenizer_is_refused(good_folder, tmp_path):
  folder = tmp_path / 'far-eos'
  shutil.copytree(good_folder, folder)
  (folder / 'generation_config.json').write_text('{"eos_token_id": [5, 9000]}')
  fails_with_one_line(folder, 'special id 9000', 'tokenizer.json')


def test_without_the_libraries_the_error_names_the_install(
    good_folder, monkeypatch):
  import sys

  from jaxformer.data import sources
  data = hf_folders.load_tokenizer(str(good_folder)).serialized_model_proto()
  monkeypatch.setitem(sys.modules, 'tokenizers', None)
  with pytest.raises(sources.DataError, match=r'pip install -e "\.\[interop'):
    tokenizer_lib.from_serialized(data, 'checkpoint')
  monkeypatch.setitem(sys.modules, 'transformers', None)
  fails_with_one_line(good_folder, 'needs transformers', 'pip install -e')
