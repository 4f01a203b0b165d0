"""Transformer (big) on WMT14 English -> German, as in the paper: the base
recipe with the big model, 300k steps and averaging of the last 20
checkpoints.

Expected: ~28.4 BLEU on newstest2014 (paper, beam 4, alpha 0.6); 3.5 days on
8 P100 GPUs for 300k steps; about a day on a v4-32 or 8 H100/H200 GPUs in
bfloat16.

  jaxformer train --config configs/wmt14_ende_big.py:bf16 --workdir gs://BUCKET/big
  jaxformer average --workdir gs://BUCKET/big --last 20 --out gs://BUCKET/big-avg

Sized for a v5p-64 (32 chips, 8 hosts) with FSDP over all chips, scanned
and rematerialised layers: `jaxformer compile --config
configs/wmt14_ende_big.py:bf16 --topology v5p-64 --config.mesh.data=1
--config.mesh.fsdp=32 --config.model.scan_layers=true
--config.model.remat_policy=full --buckets 256 --programs train` printed,
per chip of 95 GiB: train step of the widest bucket, 96x(256+256),
0.10 GiB arguments + 0.48 GiB temporaries = 0.64 GiB; the output layer in
one chunk of 768 rows per chip; collectives run per step: 75 all-reduces
(0.14 GiB, the table's gradient once), 29 all-gathers + 240 windowed, 96
windowed reduce-scatters, 3 all-to-alls, 21,840 collective-permutes (280
instructions, in scanned layers and windowed einsums). The cost model's
3.04 ms counts one layer per stack, like its 0.244 TFLOP (model: 1.03),
so the MFU of 74% it implies is not one. Unrolled, with fsdp=16 on a
v5p-32 and packed 128 x (128+128) batches (`--topology v5p-32 --config.mesh.data=1
--config.mesh.fsdp=16 --config.data.batching=pack
--config.data.batch_size=128 --config.data.max_source_length=128
--config.data.max_target_length=128`), the train step takes 0.20 GiB of
arguments and 1.00 GiB of temporaries per chip; cost model 11.3 ms per
step, MFU 26%.
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
