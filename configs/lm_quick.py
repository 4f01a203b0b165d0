"""Quick language model: a decoder-only Transformer over the built-in English
sentences (one document per line, packed into rows), on CPU in minutes.

  jaxformer train --config configs/lm_quick.py --workdir runs/lm
  jaxformer generate --workdir runs/lm --prompt "yesterday she bought"
  jaxformer generate --workdir runs/lm --input prompts.txt --temperature 0 \
      --max-new-tokens 20 --jsonl

Your own text: --config.data.source=text --config.data.text.train=train.txt
(one document per line; likewise dev and test).
`configs/lm_quick.py:runlocal` shrinks it for tests.

Sized for one CPU host. `jaxformer compile --config configs/lm_quick.py
--topology v5e-4` (data=4) printed: train step 32x64 11.0 MiB per chip of
16 GiB (fits), cost model 0.12 ms per step, MFU 1.7%; eval step 1.4 MiB.
"""
from jaxformer.config.settings import small_task_config


def get_config(arg: str = ''):
  runlocal = arg == 'runlocal'
  config = small_task_config('language_model', 'sentences', 'perplexity',
                             'min', runlocal)
  config.model.update(num_encoder_layers=0,
                      num_decoder_layers=1 if runlocal else 2,
                      share_embeddings='all')
  config.data.update(max_target_length=32 if runlocal else 64,
                     batch_size=16 if runlocal else 32)
  return config
