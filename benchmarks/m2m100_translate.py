"""Translation speed of an M2M100-shaped model: jaxformer's search beside
PyTorch `generate` (Hugging Face `M2M100ForConditionalGeneration`) and
CTranslate2 (float32 and int8) on the same weights, same thread count,
greedy and beam 4, each forced to a target language token first.

The model is a random-weight `M2M100ForConditionalGeneration` imported the
way `jaxformer import` imports one (`interop/m2m100.py`'s table), exported
to CTranslate2 the way `jaxformer export --format ct2` does; sources are
random ids framed as M2M100's tokenizer frames them (language token, ...,
</s>). As in decode_throughput.py (whose `race` this uses), EOS is off so
every engine runs every step (jaxformer eos_id=-1, CTranslate2
min_decoding_length, `generate` min_new_tokens): the work per token does
not depend on the weights. Rounds alternate between the engines in one
process; medians are printed with each engine's ratio to jaxformer, and
the load average (on a shared CPU wall time depends on it).

Shapes: 'small' (6+6 layers of 512, 8 heads, FFN 2048, vocabulary 32000),
'418m' (M2M100 418M: 12+12 layers of 1024, 16 heads, FFN 4096, vocabulary
128112; slow on a small CPU).

  python benchmarks/m2m100_translate.py [--shape small] [--batch 8]
      [--source_len 32] [--output_len 32] [--rounds 3] [--threads N]
      [--engines jaxformer,torch,ct2,ct2_int8]
"""
import argparse
import os
import tempfile

import jax.numpy as jnp
import numpy as np

from decode_throughput import NO_EOS, race
from jaxformer.inference import beam_search, search
from jaxformer.interop import ct2, m2m100
from jaxformer.model import cpu_kernels

SHAPES = {'small': dict(d_model=512, encoder_layers=6, decoder_layers=6,
                        encoder_attention_heads=8, decoder_attention_heads=8,
                        encoder_ffn_dim=2048, decoder_ffn_dim=2048,
                        vocab_size=32000),
          '418m': dict(d_model=1024, encoder_layers=12, decoder_layers=12,
                       encoder_attention_heads=16, decoder_attention_heads=16,
                       encoder_ffn_dim=4096, decoder_ffn_dim=4096,
                       vocab_size=128112)}
LANGUAGE = 5  # The id standing for the source and target language tokens.


def hf_model(shape: str):
  import torch
  from transformers import M2M100Config, M2M100ForConditionalGeneration
  torch.manual_seed(0)
  config = M2M100Config(**SHAPES[shape], max_position_embeddings=256,
                        dropout=0.0, pad_token_id=1, bos_token_id=0,
                        eos_token_id=2, decoder_start_token_id=2)
  return M2M100ForConditionalGeneration(config).eval()


def sources(batch: int, length: int, vocab: int) -> np.ndarray:
  """[batch, length] int32: the language id, random tokens, then </s>."""
  rows = np.random.default_rng(0).integers(10, vocab, (batch, length))
  rows[:, 0], rows[:, -1] = LANGUAGE, 2
  return rows.astype(np.int32)


class Engines:
  """One callable per (engine, beam) decoding `rows` to `length` tokens."""

  def __init__(self, model, rows, length, threads, names, directory):
    import torch
    hf = model.config.to_dict()
    config = m2m100.model_config(dict(hf, model_type=m2m100.MODEL_TYPE))
    weights = {k: v.detach().numpy() for k, v in model.state_dict().items()
               if 'embed_positions' not in k}
    params = m2m100.params_from_weights(weights, config)
    parts = cpu_kernels.default_batch_parts(jnp.asarray(rows))
    self.runs = {}
    for beam in (1, 4):
      if 'jaxformer' in names:
        self.runs['jaxformer', beam] = (
            lambda b=beam: search.greedy_decode(
                params, config, rows, max_decode_len=length, eos_id=NO_EOS,
                batch_parts=parts, forced_ids=LANGUAGE) if b == 1 else
            beam_search.beam_search(
                params, config, rows, beam_size=b, max_decode_len=length,
                eos_id=NO_EOS, batch_parts=parts, forced_ids=LANGUAGE))
    if 'torch' in names:
      torch.set_num_threads(threads)
      ids = torch.from_numpy(rows.astype(np.int64))

      def generate(beam):
        with torch.inference_mode():
          return model.generate(
              input_ids=ids, num_beams=beam, do_sample=False,
              forced_bos_token_id=LANGUAGE, max_new_tokens=length,
              min_new_tokens=length)
      for beam in (1, 4):
        self.runs['torch', beam] = lambda b=beam: generate(b)
    vocabulary = ['<s>', '<pad>', '</s>', '<unk>'] + [
        f'p{i}' for i in range(4, config.vocab_size)]
    source = [[vocabulary[t] for t in row] for row in rows]
    for name, quantization in (('ct2', None), ('ct2_int8', 'int8')):
      if name not in names:
        continue
      import ctranslate2
      folder = os.path.join(directory, name)
      ct2.write(params, config, vocabulary, vocabulary, '<unk>', folder,
                quantization, add_source_eos=False)
      translator = ctranslate2.Translator(
          folder, device='cpu', compute_type=quantization or 'float32',
          inter_threads=1, intra_threads=threads)
      prefix = [[vocabulary[LANGUAGE]]] * len(source)
      for beam in (1, 4):
        self.runs[name, beam] = (
            lambda t=translator, b=beam: t.translate_batch(
                source, target_prefix=prefix, beam_size=b,
                max_decoding_length=length, min_decoding_length=length,
                max_batch_size=len(source)))


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--shape', default='small', choices=sorted(SHAPES))
  parser.add_argument('--engines', default='jaxformer,torch,ct2,ct2_int8')
  parser.add_argument('--batch', type=int, default=8)
  parser.add_argument('--source_len', type=int, default=32)
  parser.add_argument('--output_len', type=int, default=32)
  parser.add_argument('--rounds', type=int, default=3)
  parser.add_argument('--threads', type=int, default=os.cpu_count())
  args = parser.parse_args()
  model = hf_model(args.shape)
  rows = sources(args.batch, args.source_len, model.config.vocab_size)
  print(f'{args.threads} threads; batch {args.batch}, sources of '
        f'{args.source_len} tokens, {args.output_len} output tokens per '
        f'sentence (EOS off); load average {os.getloadavg()[0]:.1f}\n\n'
        '| model | search | engine | output tokens/s | ms per batch | '
        'ms CPU | ratio |\n|---|---|---|---:|---:|---:|---|', flush=True)
  with tempfile.TemporaryDirectory() as directory:
    engines = Engines(model, rows, args.output_len, args.threads,
                      args.engines.split(','), directory)
    race(engines, args.rounds, args.batch * args.output_len,
         f'M2M100 {args.shape}')
  print(f'load average {os.getloadavg()[0]:.1f}')


if __name__ == '__main__':
  main()
