"""Transformer (big) on WMT14 English -> German, as in the paper: the base
recipe with the big model, 300k steps and averaging of the last 20
checkpoints.

Expected: ~28.4 BLEU on newstest2014 (paper, beam 4, alpha 0.6); 3.5 days on
8 P100 GPUs for 300k steps; about a day on a v4-32 or 8 H100/H200 GPUs in
bfloat16.

  jaxformer train --config configs/wmt14_ende_big.py:bf16 --workdir gs://BUCKET/big
  jaxformer average --workdir gs://BUCKET/big --last 20 --out gs://BUCKET/big-avg
"""
import importlib.util
import os

from jaxformer.model import config as model_config


def _base_config(arg: str):
  path = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                      'wmt14_ende_base.py')
  spec = importlib.util.spec_from_file_location('wmt14_ende_base', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg)


def get_config(arg: str = ''):
  config = _base_config(arg)
  dtype = config.model.dtype
  config.model = model_config.big()  # 1024/4096/16 heads/6+6, dropout 0.3
  config.model.update(max_len=256, share_embeddings='all', dtype=dtype)
  config.train.num_steps = 300_000
  config.eval.every = 10_000
  config.checkpoint.update(every=5000, keep=20)
  return config
