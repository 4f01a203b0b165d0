"""Peak host memory does not grow with the corpus: a process whose data
memory is capped at 200 MB over what it holds after its imports tokenizes
and serves a language model corpus whose rows, made whole in memory as
before (about 80 bytes a byte of text), need several times that."""
import os
import subprocess
import sys
import textwrap

import pytest

from jaxformer.data import builtin

SCRIPT = textwrap.dedent('''
    import resource, sys
    import numpy as np
    import ml_collections
    from jaxformer.data import lm_rows, task_batches
    from jaxformer.data import tokenizer as tokenizer_lib
    from jaxformer.data.defaults import default_data_config

    def data_bytes():
      for line in open('/proc/self/status'):
        if line.startswith('VmData:'):
          return int(line.split()[1]) * 1024

    corpus, model, cache = sys.argv[1:4]
    tok = tokenizer_lib.Tokenizer.from_serialized(open(model, 'rb').read())
    config = ml_collections.ConfigDict(dict(
        task='language_model', model={}, init={}, data=default_data_config()))
    config.data.update(source='text', max_target_length=128, batch_size=16,
                       token_cache_piece_bytes=1 << 20)
    config.data.text.update(train=corpus, dev=corpus)
    limit = data_bytes() + (200 << 20)
    resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
    batches = task_batches.train_batches(config, tok, tok, token_cache=cache)
    tokens = sum(int(next(batches)['targets_segment_ids'].astype(bool).sum())
                 for _ in range(50))
    resumed = next(task_batches.train_batches(
        config, tok, tok, start_step=10**6, token_cache=cache))
    assert tokens > 50 * 16 * 100 and resumed['targets'].any()
    print('served', flush=True)
    texts = open(corpus, encoding='utf-8').read().splitlines()
    try:  # The rows made whole in memory, as before: over the cap.
      lm_rows.pack_documents(lm_rows.document_ids(tok, texts), 128)
    except MemoryError:
      print('in memory: MemoryError')
''')


@pytest.mark.slow
def test_a_corpus_larger_than_the_memory_cap_is_served(tmp_path, tok):
  sentences = [s for s, _ in builtin.generate(2000, 1, 'train')]
  block = ''.join(' '.join(sentences[i:i + 3]) + '\n'
                  for i in range(0, len(sentences) - 3))
  with open(tmp_path / 'lm.txt', 'w', encoding='utf-8') as f:
    for _ in range((8 << 20) // len(block) + 1):  # 8 MB of text.
      f.write(block)
  model = tmp_path / 'joint.model'
  model.write_bytes(tok.serialized_model_proto())
  done = subprocess.run(
      [sys.executable, '-c', SCRIPT, str(tmp_path / 'lm.txt'), str(model),
       str(tmp_path / 'cache')], capture_output=True, text=True, timeout=300,
      env={**os.environ, 'PYTHONPATH': os.pathsep.join(sys.path)})
  assert done.returncode == 0, done.stderr[-3000:]
  assert done.stdout.split('\n')[:2] == ['served', 'in memory: MemoryError']
