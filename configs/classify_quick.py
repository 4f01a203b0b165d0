"""Quick classification: is the number written out in a built-in English
sentence even or odd? An encoder-only Transformer, trained on CPU in minutes.

  jaxformer train --config configs/classify_quick.py --workdir runs/classify
  echo "she bought forty-two red apples ." | jaxformer predict --workdir runs/classify

Your own data: --config.data.source=tsv --config.data.tsv.train=train.tsv
(lines 'text<TAB>label'; likewise dev and test).
`configs/classify_quick.py:runlocal` shrinks it for tests.
"""
from jaxformer.config import small_task_config


def get_config(arg: str = ''):
  runlocal = arg == 'runlocal'
  config = small_task_config('classification', 'number_parity', 'accuracy',
                             'max', runlocal)
  config.model.update(num_encoder_layers=1 if runlocal else 2,
                      num_decoder_layers=0, pooling='mean',
                      position_embedding='learned')
  config.data.update(max_source_length=24, batch_size=32 if runlocal else 64)
  return config
