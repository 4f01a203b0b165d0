"""The `data` part of the run config, with every key's default.

Kept apart from the pipeline so that loading a config needs no TensorFlow.
"""
import ml_collections

# The keys of JSONL records (Parquet columns) holding each field; dots name
# nested values. 'source'/'target' fall back to Hugging Face's
# {"translation": {source_language: ..., target_language: ...}}.
_FIELDS = dict(text='text', label='label', text_a='text_a', text_b='text_b',
               prompt='prompt', response='response', source='source',
               target='target', source_language='en', target_language='de')


# The keys of `data` with a fixed set of values (config validation).
DATA_CHOICES = {
    'source': ('builtin', 'tsv', 'files', 'tfds', 'text', 'jsonl', 'parquet'),
    'batching': ('pack', 'bucket'),
    'tokenizer.type': ('bpe', 'unigram', 'char', 'word'),
    'builtin.dataset': ('translation', 'number_parity', 'number_value',
                        'sentences'),
}


def default_data_config() -> ml_collections.ConfigDict:
  """The `data` part of the training config, set up for the built-in dataset."""
  return ml_collections.ConfigDict(dict(
      # 'builtin' | 'tsv' | 'files' | 'tfds' | 'text' | 'jsonl' | 'parquet'
      source='builtin',
      # dataset: translation | number_parity | number_value | sentences
      builtin=dict(num_train=200_000, num_dev=1000, num_test=1000, seed=0,
                   dataset='translation'),
      text=dict(train='', dev='', test=''),  # one document per line (LM)
      # Class names of classification, in id order; [] means the sorted
      # labels of the train split (then saved in the run's config).
      labels=[],
      tsv=dict(train='', dev='', test=''),  # 'source<TAB>target' lines, .gz ok
      files=dict(train_source='', train_target='', dev_source='',
                 dev_target='', test_source='', test_target=''),
      tfds=dict(name='wmt14_translate/de-en', data_dir=None,
                source_language='en', target_language='de',
                train_split='train', dev_split='validation', test_split='test'),
      # Training on several sources drawn by weight, optionally in stages
      # (docs/data.md, "Mixtures"; data/mixture.py); [] trains on
      # data.source. Evaluation reads data.source's dev and test splits.
      #   sources=[{'name': 'news', 'source': 'tsv',
      #             'tsv': {'train': 'news.tsv'}, 'weight': 3}, ...]
      #   stages=[{'until_step': 10000, 'weights': {'news': 1, 'web': 1}},
      #           {'weights': {'news': 3, 'web': 1}}]
      mixture=dict(sources=[], stages=[]),
      tokenizer=dict(
          model_path='',  # an existing joint model to use instead of training
          source_model_path='', target_model_path='',  # the same, joint=False
          # BPE: on the built-in data SentencePiece's unigram trainer keeps
          # mostly single letters (twice the tokens per sentence).
          type='bpe',
          vocab_size=512,  # per model; the built-in data allows at most ~600
          target_vocab_size=0,  # joint=False: the target model's; 0: vocab_size
          character_coverage=1.0,
          sample_size=20_000,  # train pairs sampled to train the tokenizer
          joint=True,
          wait_seconds=3600.0,  # how long processes > 0 wait for process 0's model
      ),
      # A many-to-many model's (M2M100/NLLB) language pair, by its codes
      # ('en', 'deu_Latn'): sources start with source_lang's token, targets
      # with target_lang's, which decoding forces first; '' for other models.
      source_lang='', target_lang='',
      max_source_length=64,  # tokens incl. EOS; longer examples are dropped
      max_target_length=64,  # from training, truncated in evaluation
      batching='pack',  # 'pack' | 'bucket'
      # language_model rows (data/lm_rows.py): 'packed' (documents, every
      # token trained on) | 'prompt_response' ('prompt<TAB>response' lines,
      # one pair per row, the loss on the response and its EOS only).
      lm_rows='packed',
      batch_size=32,  # global rows per batch ('pack' and evaluation)
      tokens_per_batch=4096,  # global tokens per side and batch ('bucket')
      # 'bucket' batches hold a multiple of mesh.data x mesh.fsdp x
      # train.grad_accum_steps rows, so resuming with another multiple
      # changes the examples of every later batch: refused unless True.
      allow_new_data_order=False,
      # Each epoch uses a full seeded permutation (a buffer as large as the
      # data); 0 keeps the file order.
      shuffle_buffer=10000,
      seed=0,
      # Tokenise each split once into sharded .npy files, reused by resumes
      # and later runs on the same data and tokenizer (data/token_cache.py);
      # False tokenises in memory at every start.
      token_cache=True,
      token_cache_dir='',  # '' = <workdir>/tokenizer/token_cache; or gs://...
      # The row tasks' input is tokenized in pieces of about this many bytes
      # (a file's byte range), shared among the processes, each with this
      # many local workers (data/token_shards.py).
      token_cache_piece_bytes=64 << 20,
      tokenize_workers=1,
      # JSONL and Parquet files (globs, .gz): each field's key, by default
      # its name (data/records.py).
      jsonl=dict(train='', dev='', test='', **_FIELDS),
      parquet=dict(train='', dev='', test='', **_FIELDS),
  ))
