"""Quick regression: the value of the number written out in a built-in
English sentence, scaled to [0, 1]. An encoder-only Transformer on CPU.

  jaxformer train --config configs/regress_quick.py --workdir runs/regress
  echo "she bought forty-two red apples ." | jaxformer predict --workdir runs/regress

Your own data: --config.data.source=tsv (lines 'text<TAB>value', with
model.regression_dim space-separated numbers).
`configs/regress_quick.py:runlocal` shrinks it for tests.

Sized for one CPU host. `jaxformer compile --config configs/regress_quick.py
--topology v5e-4` (data=4) printed: train step 64x24 12.0 MiB per chip of
16 GiB (fits), cost model 0.10 ms per step, MFU 1.3%; eval step 3.2 MiB.
"""
from jaxformer.config.settings import small_task_config


def get_config(arg: str = ''):
  runlocal = arg == 'runlocal'
  config = small_task_config('regression', 'number_value', 'pearson', 'max',
                             runlocal)
  config.model.update(num_encoder_layers=1 if runlocal else 2,
                      num_decoder_layers=0, pooling='mean',
                      position_embedding='learned', regression_dim=1)
  config.data.update(max_source_length=24, batch_size=32 if runlocal else 64)
  return config
