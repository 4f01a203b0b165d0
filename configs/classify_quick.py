"""Quick classification: is the number written out in a built-in English
sentence even or odd? An encoder-only Transformer, trained on CPU in minutes.

  jaxformer train --config configs/classify_quick.py --workdir runs/classify
  echo "she bought forty-two red apples ." | jaxformer predict --workdir runs/classify

Your own data: --config.data.source=tsv --config.data.tsv.train=train.tsv
(lines 'text<TAB>label', or 'text_a<TAB>text_b<TAB>label' for sentence
pairs; likewise dev and test).
`configs/classify_quick.py:runlocal` shrinks it for tests.

Sized for one CPU host. `jaxformer compile --config configs/classify_quick.py
--topology v5e-4` (data=4) printed: train step 64x24 12.1 MiB per chip of
16 GiB (fits), cost model 0.10 ms per step, MFU 1.2%; eval step 1.5 MiB.
"""
from jaxformer.config.settings import small_task_config


def get_config(arg: str = ''):
  runlocal = arg == 'runlocal'
  config = small_task_config('classification', 'number_parity', 'accuracy',
                             'max', runlocal)
  config.model.update(num_encoder_layers=1 if runlocal else 2,
                      num_decoder_layers=0, pooling='mean',
                      position_embedding='learned')
  config.data.update(max_source_length=24, batch_size=32 if runlocal else 64)
  return config
