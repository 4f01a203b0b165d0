"""Oversized input never makes a reader hold it: a line over the limit, a
.gz that inflates a thousandfold, a vocab.json of any size, a long line to
`translate`, an endless stdin each end in one error naming the file (and
line) while the process's memory stays under a small budget (its address
space limited with RLIMIT_AS in a process of its own); `predict` reads its
input a batch at a time."""
import gzip
import io
import os
import subprocess
import sys
import textwrap

import pytest

from jaxformer.data import input_errors
from jaxformer.data import sources

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIB = 1 << 20

# The child's start: imports done, then `bounded(mib)` lets its address
# space grow by `mib` MiB at most. glibc's malloc as it comes (jaxformer's
# settings pre-reserve 256 MiB steps of heap) with one arena: a thread's
# arena would reserve 64 MiB of addresses.
CHILD = '''
import resource
from jaxformer.data import sources

def bounded(mib):
  with open('/proc/self/status') as f:
    size = next(int(l.split()[1]) << 10 for l in f if l.startswith('VmSize'))
  limit = size + (mib << 20)
  resource.setrlimit(resource.RLIMIT_AS, (limit, resource.RLIM_INFINITY))
'''


def run_bounded(code: str, budget_mib: int) -> str:
  """What `code` prints, run after CHILD in a process of its own; fails if
  it does not exit 0 (a MemoryError: the budget was not enough)."""
  env = dict(os.environ, PYTHONPATH=REPO, JAXFORMER_SYSTEM_MALLOC='1',
             MALLOC_ARENA_MAX='1')
  env.pop(input_errors.LINE_BYTES_ENV, None)
  script = CHILD + textwrap.dedent(code).replace('BUDGET', str(budget_mib))
  result = subprocess.run([sys.executable, '-c', script], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-2000:]
  return result.stdout


def gzip_of_one_line(path, mib: int) -> str:
  """A .gz of `mib` MiB of 'a' without a newline (~1 KB per MiB)."""
  with gzip.open(path, 'wb', compresslevel=9) as f:
    for _ in range(mib):
      f.write(b'a' * MIB)
  return str(path)


@pytest.fixture(scope='module')
def spm_model(tmp_path_factory) -> bytes:
  """A small SentencePiece model of the built-in sentences."""
  from jaxformer.data import builtin, tokenizer
  from jaxformer.data.defaults import default_data_config
  settings = default_data_config().tokenizer
  settings.vocab_size = 100
  texts = [text for pair in builtin.generate(300, 0, 'train') for text in pair]
  prefix = str(tmp_path_factory.mktemp('spm') / 'joint')
  return tokenizer.train_tokenizer(texts, prefix,
                                   settings).serialized_model_proto()


@pytest.fixture(scope='module')
def bomb(tmp_path_factory):
  """The finding's file: 382 KB of .gz, one 384 MiB line."""
  return gzip_of_one_line(tmp_path_factory.mktemp('bomb') / 'one.txt.gz', 384)


@pytest.mark.slow
def test_a_gz_of_one_huge_line_is_refused_naming_the_line(bomb):
  out = run_bounded(f'''
      bounded(BUDGET)
      try:
        for line in sources.iter_lines({bomb!r}):
          pass
      except sources.DataError as e:
        print(e)
      ''', 96)
  assert f'{bomb}:1: the line is longer than {input_errors.MAX_LINE_BYTES} bytes' \
      in out
  assert input_errors.LINE_BYTES_ENV in out


@pytest.mark.slow
def test_a_gz_tokenizer_is_read_up_to_the_file_limit(bomb):
  out = run_bounded(f'''
      from jaxformer.data import tokenizer
      bounded(BUDGET)
      try:
        tokenizer.load_tokenizer({bomb!r})
      except sources.DataError as e:
        print(e)
      ''', 192)
  assert f'{bomb}: more than {sources.MAX_FILE_BYTES} bytes once ' \
      'decompressed' in out


@pytest.mark.slow
def test_a_vocab_json_of_any_size_is_refused_before_it_is_parsed(
    tmp_path, spm_model):
  for name in ('source.spm', 'target.spm'):
    (tmp_path / name).write_bytes(spm_model)
  with open(tmp_path / 'vocab.json', 'wb') as f:
    f.truncate(256 * MIB)  # Sparse: no disk used.
  out = run_bounded(f'''
      from jaxformer.data import vocab_tokenizer
      bounded(BUDGET)
      try:
        vocab_tokenizer.from_marian_folder({str(tmp_path)!r})
      except sources.DataError as e:
        print(e)
      ''', 128)
  assert f'{tmp_path}/vocab.json: more than {sources.MAX_FILE_BYTES} ' \
      'bytes' in out


@pytest.mark.slow
def test_an_endless_input_line_is_refused_naming_it():
  out = run_bounded('''
      import io

      class Endless(io.RawIOBase):  # stdin of `yes | tr -d '\\n'`
        def readable(self):
          return True

        def readinto(self, buffer):
          buffer[:] = b'y' * len(buffer)
          return len(buffer)

      bounded(BUDGET)
      try:
        next(sources.decode_lines(io.BufferedReader(Endless()), '<stdin>'))
      except sources.DataError as e:
        print(e)
      ''', 64)
  assert f'<stdin>:1: the line is longer than {input_errors.MAX_LINE_BYTES}' in out


@pytest.mark.slow
def test_a_long_line_to_translate_is_cut_before_it_is_encoded(
    tmp_path, spm_model):
  """The finding: a 20 MB line was encoded whole (+1.2 GB) before
  truncation."""
  (tmp_path / 'joint.model').write_bytes(spm_model)
  out = run_bounded(f'''
      from jaxformer.data import tokenizer
      from jaxformer.inference import evaluate
      tok = tokenizer.load_tokenizer({str(tmp_path / 'joint.model')!r})
      bounded(BUDGET)
      line = 'she bought forty-two red apples . ' * 600_000
      rows, truncated = evaluate.encode_sources(tok, ['one .', line], 64)
      print(rows.shape, truncated)
      ''', 128)
  assert out.strip() == '(2, 64) [1]'


# ------------------------------------------------- the limits themselves


def write(path, data: bytes) -> str:
  path.write_bytes(data)
  return str(path)


def test_a_line_over_the_limit_is_named_wherever_it_lies(tmp_path,
                                                         monkeypatch):
  monkeypatch.setenv(input_errors.LINE_BYTES_ENV, '10')
  ok = write(tmp_path / 'ok.txt', b'0123456789\nab\r\n' + b'x' * 10)
  assert list(sources.iter_lines(ok)) == ['0123456789', 'ab', 'x' * 10]
  for data, line in ((b'a\nbb\n' + b'x' * 11 + b'\nc\n', 3),
                     (b'a\n' + b'x' * 11, 2), (b'x' * 30 + b'\n', 1)):
    path = write(tmp_path / 'long.txt', data)
    for read in (sources.iter_lines, sources.count_lines):
      with pytest.raises(sources.DataError,
                         match=f'long.txt:{line}: the line is longer than '
                         '10 bytes'):
        list(read(path)) if read is sources.iter_lines else read(path)
    with pytest.raises(sources.DataError, match=f'in:{line}: the line'):
      list(sources.decode_lines(io.BufferedReader(io.BytesIO(data)), 'in'))
    with pytest.raises(sources.DataError, match=f'in:{line}: the line'):
      list(sources.decode_lines(io.BytesIO(data).readlines(), 'in'))


def test_the_line_limit_takes_a_positive_number(monkeypatch):
  assert input_errors.max_line_bytes({}) == input_errors.MAX_LINE_BYTES
  assert input_errors.max_line_bytes({input_errors.LINE_BYTES_ENV: '4096'}) == 4096
  for bad in ('0', '-5', 'lots'):
    with pytest.raises(sources.DataError, match=input_errors.LINE_BYTES_ENV):
      input_errors.max_line_bytes({input_errors.LINE_BYTES_ENV: bad})


def test_input_lines_come_as_they_are_written():
  """A pipe's lines are read as they come, so `translate` answers each."""
  read, write_end = os.pipe()
  with open(read, 'rb') as stream, open(write_end, 'wb', buffering=0) as w:
    lines = sources.decode_lines(stream, '<stdin>')
    w.write(b'first\n')
    assert next(lines) == 'first'
    w.write(b'second\r\nthird')
    w.close()
    assert list(lines) == ['second', 'third']


@pytest.mark.slow
def test_predict_reads_its_input_a_batch_at_a_time(spm_model):
  """`predict` held all its input before the first prediction."""
  import flax.linen as nn
  import jax
  from jaxformer.config.settings import load_config
  from jaxformer.data import tokenizer
  from jaxformer.inference import predict
  from jaxformer.model import config as model_config_lib
  from jaxformer.train.tasks import get_task
  tok = tokenizer.Tokenizer.from_serialized(spm_model)
  config = load_config('configs/classify_quick.py:runlocal', [])
  config.data.labels = ['even', 'odd']
  config.model.update(vocab_size=tok.vocab_size, num_classes=2, d_model=16,
                      d_ff=32, num_heads=2)
  model_config = model_config_lib.from_config_dict(config.model)
  task = get_task(config.task)
  params = nn.unbox(task.init_variables(
      task.model(model_config), jax.random.PRNGKey(0),
      task.example_batch(config)))['params']
  read = []

  def endless():  # An input that never ends: only streaming answers.
    while True:
      read.append(len(read))
      yield 'she bought forty-two red apples . ' * (len(read) % 3 * 10_000)

  outputs = predict.predict_lines(params, model_config, config, tok,
                                  endless(), batch_size=4)
  first = [next(outputs) for _ in range(6)]
  assert set(first) <= {'even', 'odd'}
  assert len(read) == 8  # Two batches.
