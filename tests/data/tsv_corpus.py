"""A small TSV corpus for the tests of data/, and its data config."""
from jaxformer.data import builtin
from jaxformer.data.defaults import default_data_config

PAIRS = builtin.generate(120, 5, 'train')


def write_tsv(path, pairs=PAIRS):
  """Writes `pairs` to `path` as source<TAB>target lines; returns `path`."""
  path.write_text(''.join(f'{s}\t{t}\n' for s, t in pairs), encoding='utf-8')
  return path


def tsv_config(path, **overrides):
  """A data config reading train split `path`, a 150-piece tokenizer and
  rows of 40 tokens a side, with `overrides`."""
  config = default_data_config()
  config.source = 'tsv'
  config.tsv.train = str(path)
  config.tokenizer.vocab_size = 150
  config.update(max_source_length=40, max_target_length=40)
  config.update(overrides)
  return config
