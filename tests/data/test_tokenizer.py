import io
import os
import re
import threading
import time

import numpy as np
import pytest
import sentencepiece as spm

from jaxformer.data import builtin
from jaxformer.data.defaults import default_data_config
from jaxformer.data import sources
from jaxformer.data import tokenizer as tokenizer_lib
from jaxformer.data.sources import DataError
from jaxformer.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID

VOCAB_SIZE = 200


def small_config():
  config = default_data_config()
  config.builtin.update(num_train=1000, num_dev=20, num_test=20)
  config.tokenizer.update(vocab_size=VOCAB_SIZE, sample_size=500)
  return config


@pytest.fixture(scope='module')
def trained(tmp_path_factory):
  texts = [text for pair in builtin.generate(1000, 0, 'train') for text in pair]
  prefix = str(tmp_path_factory.mktemp('tokenizer') / 'model')
  return tokenizer_lib.train_tokenizer(texts, prefix, small_config().tokenizer), prefix


def test_special_ids_are_fixed(trained):
  tokenizer, _ = trained
  pieces = [tokenizer.id_to_piece(i) for i in (PAD_ID, EOS_ID, UNK_ID, BOS_ID)]
  assert pieces == ['<pad>', '</s>', '<unk>', '<s>']
  assert tokenizer.vocab_size == VOCAB_SIZE


def test_encode_appends_eos_and_decode_inverts_it(trained):
  tokenizer, _ = trained
  texts = ['yesterday she bought forty-two red apples .',
           'gestern kaufte sie zweiundvierzig rote Äpfel .']
  ids = tokenizer.encode(texts)
  assert all(row[-1] == EOS_ID and EOS_ID not in row[:-1] for row in ids)
  assert [tokenizer.decode(row) for row in ids] == texts


def test_decode_stops_at_eos_and_ignores_padding(trained):
  tokenizer, _ = trained
  ids = tokenizer.encode(['heute', 'dann'])
  padded = np.zeros((2, 12), np.int32)
  padded[0, :len(ids[0])] = ids[0]
  padded[1, :len(ids[1])] = ids[1]
  padded[0, len(ids[0]) + 1:len(ids[0]) + 1 + len(ids[1])] = ids[1]
  assert tokenizer.decode_batch(padded) == ['heute', 'dann']
  assert tokenizer.decode([PAD_ID] + ids[1]) == 'dann'


def test_unknown_characters_map_to_unk(trained):
  tokenizer, _ = trained
  assert UNK_ID in tokenizer.encode(['東京'])[0]


def test_serialized_model_round_trips(trained):
  tokenizer, prefix = trained
  restored = tokenizer_lib.Tokenizer.from_serialized(tokenizer.serialized_model_proto())
  assert restored.encode(['dann sahen wir']) == tokenizer.encode(['dann sahen wir'])
  assert tokenizer_lib.load_tokenizer(prefix + '.model').vocab_size == VOCAB_SIZE


def test_get_or_train_trains_once_then_reuses_the_workdir_model(tmp_path):
  config = small_config()
  source_tok, target_tok = tokenizer_lib.get_or_train(config, str(tmp_path), process_index=0)
  path = tmp_path / 'tokenizer' / 'joint.model'
  assert source_tok is target_tok and path.exists()
  written = path.stat().st_mtime_ns
  config.source = 'tsv'  # Would fail if the train split were read again.
  again, _ = tokenizer_lib.get_or_train(config, str(tmp_path), process_index=0)
  assert path.stat().st_mtime_ns == written
  assert again.serialized_model_proto() == source_tok.serialized_model_proto()


def test_the_sample_is_seeded_and_streamed_never_whole(tmp_path, monkeypatch):
  pairs = builtin.generate(300, 1, 'train')
  config = small_config()
  config.update(source='tsv', seed=7)
  config.tsv.train = str(tmp_path / 'train.tsv')
  (tmp_path / 'train.tsv').write_text(
      ''.join(f'{s}\t{t}\n' for s, t in pairs), encoding='utf-8')
  config.tokenizer.sample_size = 50
  monkeypatch.setattr(sources, 'read_split', lambda *a: pytest.fail('read whole'))
  monkeypatch.setattr(sources, '_BLOCK_BYTES', 1000)
  chosen = np.sort(np.random.default_rng(7).choice(300, 50, replace=False))
  assert list(tokenizer_lib._sample(config)) == [pairs[i] for i in chosen]
  config.tokenizer.sample_size = 1000
  assert list(tokenizer_lib._sample(config)) == pairs
  monkeypatch.setattr(sources, 'count_pairs', lambda *a: 310)  # Then shrunk.
  with pytest.raises(DataError, match='had 310 pairs when counted, then fewer'):
    list(tokenizer_lib._sample(config))


@pytest.mark.parametrize('joint', [True, False])
def test_labelled_examples_train_the_tokenizer_on_their_texts_only(
    tmp_path, joint):
  """Classification and regression files: 'text<TAB>label' or
  'text_a<TAB>text_b<TAB>label' lines; a model learns every text, no label."""
  config = small_config()
  config.update(source='tsv', seed=3)
  config.tokenizer.joint = joint
  config.tsv.train = str(tmp_path / 'train.tsv')
  for lines, texts in [
      (['a b\tc d\tsame', 'e f\tg h\tdifferent'], ['a b', 'e f', 'c d', 'g h']),
      (['a b\t0.5', 'e f\t1.5'], ['a b', 'e f'])]:
    (tmp_path / 'train.tsv').write_text('\n'.join(lines) + '\n')
    got = tokenizer_lib._training_texts(config, with_labels=True)
    assert got == (texts,) * (1 if joint else 2)


def test_separate_source_and_target_models(tmp_path):
  config = small_config()
  config.tokenizer.update(joint=False, vocab_size=100)
  source_tok, target_tok = tokenizer_lib.get_or_train(config, str(tmp_path), process_index=0)
  assert sorted(os.listdir(tmp_path / 'tokenizer')) == ['source.model', 'target.model']
  assert source_tok.serialized_model_proto() != target_tok.serialized_model_proto()
  assert target_tok.encode(['Äpfel'])[0][0] != UNK_ID


def test_given_model_is_copied_into_the_workdir(trained, tmp_path):
  _, prefix = trained
  config = small_config()
  config.source = 'tsv'  # The given model needs no training data.
  config.tokenizer.model_path = prefix + '.model'
  tokenizer_lib.get_or_train(config, str(tmp_path), process_index=0)
  copied = (tmp_path / 'tokenizer' / 'joint.model').read_bytes()
  assert copied == open(prefix + '.model', 'rb').read()


def test_vocab_size_mismatch_is_an_error(trained, tmp_path):
  _, prefix = trained
  config = small_config()
  config.tokenizer.update(model_path=prefix + '.model', vocab_size=VOCAB_SIZE + 1)
  with pytest.raises(DataError, match=rf'vocabulary of {VOCAB_SIZE} pieces but '
                     rf'data.tokenizer.vocab_size is {VOCAB_SIZE + 1}'):
    tokenizer_lib.get_or_train(config, str(tmp_path), process_index=0)


def test_model_with_other_special_ids_is_rejected(tmp_path):
  model = io.BytesIO()
  spm.SentencePieceTrainer.train(  # SentencePiece's defaults: unk=0 bos=1 eos=2.
      sentence_iterator=iter(['a b c d e f'] * 10), model_writer=model,
      vocab_size=10, logstream=open(os.devnull, 'w'))
  with pytest.raises(DataError, match='special ids'):
    tokenizer_lib.Tokenizer.from_serialized(model.getvalue())


@pytest.mark.slow
def test_other_processes_wait_for_process_zero(trained, tmp_path):
  tokenizer, _ = trained
  config = small_config()
  config.tokenizer.wait_seconds = 0.5
  with pytest.raises(TimeoutError, match='process 0'):
    tokenizer_lib.get_or_train(config, str(tmp_path), process_index=1)

  config.tokenizer.wait_seconds = 30
  path = tmp_path / 'tokenizer' / 'joint.model'
  def process_zero_writes_later():
    time.sleep(0.3)
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(tokenizer.serialized_model_proto())
  writer = threading.Thread(target=process_zero_writes_later)
  writer.start()
  waited, _ = tokenizer_lib.get_or_train(config, str(tmp_path), process_index=1)
  writer.join()
  assert waited.vocab_size == VOCAB_SIZE


def test_other_hosts_take_process_0s_model_hash_and_check_their_files(
    trained, tmp_path):
  """With `agree` (the runtime's key-value store in a run, a dict here),
  process 1 waits for process 0's sha256 instead of polling for files, and
  a model of other bytes (a host's stale copy) names the workdir."""
  _, prefix = trained
  config = small_config()
  config.source = 'tsv'  # The given model needs no training data.
  config.tokenizer.model_path = prefix + '.model'
  shared, sent = tmp_path / 'shared', {}

  def as_process_0(name, compute, pattern):
    sent[name] = compute()
    assert re.fullmatch(pattern, sent[name])
    return sent[name]

  made, _ = tokenizer_lib.get_or_train(config, str(shared), process_index=0,
                                       agree=as_process_0)
  as_process_1 = lambda name, compute, pattern: sent[name]
  read, _ = tokenizer_lib.get_or_train(config, str(shared), process_index=1,
                                       agree=as_process_1)
  assert read.serialized_model_proto() == made.serialized_model_proto()
  stale = tmp_path / 'stale'
  (stale / 'tokenizer').mkdir(parents=True)
  (stale / 'tokenizer' / 'joint.model').write_bytes(
      (shared / 'tokenizer' / 'joint.model').read_bytes() + b'\0')
  with pytest.raises(DataError, match=f'process 0 wrote the tokenizer model '
                     f'.*the workdir {stale} must be shared by all hosts'):
    tokenizer_lib.get_or_train(config, str(stale), process_index=1,
                               agree=as_process_1)
