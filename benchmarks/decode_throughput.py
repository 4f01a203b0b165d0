"""Decoding throughput of greedy search and beam search: jaxformer beside
CTranslate2 (float32 and int8) and PyTorch `generate` (Hugging Face
`MarianMTModel`, or `LlamaForCausalLM` for the 'llama' model) on the same
weights, same thread count.

Output tokens/s counts the tokens of the returned sentences only (one per
sentence, the best beam), with EOS disabled so that every engine runs every
step (jaxformer eos_id=-1, CTranslate2 min_decoding_length, `generate`
min_new_tokens): the work per token does not depend on the weights, so
random ones serve. Rounds alternate between the engines, in one process;
medians are printed, with each engine's ratio to jaxformer. jaxformer's
compile time (first call minus a steady-state call) is reported
separately. On a single CPU device jaxformer decodes a batch as one part
per core, side by side (`cpu_kernels.default_batch_parts`; `--batch_parts
1` decodes it in one piece). The machine's load average is printed too: on
a shared CPU, wall time depends on it.

Models: 'small' (that of docs/performance.md's jaxformer-only row: `--models
small --engines jaxformer --source_len 64`), 'quickstart' (its
config; `--workdir` of a trained quick start run uses its weights and test
sentences, and also prints how many greedy outputs CTranslate2 reproduces),
'base' (Transformer base, 6+6 layers of 512, vocabulary 32000), 'llama'
(a random-weight Hugging Face Llama of `LLAMA`'s size imported with
`jaxformer import`, see `LlamaEngines`: greedy continuations of
--source_len-token prompts by --output_len tokens, at batch 1 and --batch;
engine 'jaxformer_stepwise' is generation without prefill). PyTorch
runs the weights as a `MarianMTModel` (`interop/hf_marian.py`); for a
config Marian cannot express exactly (the paper's interleaved sinusoid,
LayerNorm epsilon 1e-6) it computes the same amount, not the same numbers.

  python benchmarks/decode_throughput.py [--models quickstart,base,llama]
      [--engines jaxformer,ct2,ct2_int8,torch[,jaxformer_stepwise]]
      [--workdir RUN] [--rounds 5]
      [--batch 8] [--source_len 32] [--output_len 64] [--threads N]
"""
import argparse
import json
import os
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer.inference import beam_search, search
from jaxformer.model import EncoderDecoder, ModelConfig, cpu_kernels

MODELS = {
    'small': ModelConfig(vocab_size=8000, d_model=256, num_heads=4, d_ff=1024,
                         num_encoder_layers=3, num_decoder_layers=3,
                         max_len=256),
    'quickstart': ModelConfig(vocab_size=512, d_model=128, num_heads=4,
                              d_ff=512, num_encoder_layers=2,
                              num_decoder_layers=2, max_len=128),
    'base': ModelConfig(vocab_size=32000, d_model=512, num_heads=8, d_ff=2048,
                        num_encoder_layers=6, num_decoder_layers=6,
                        max_len=256),
}
NO_EOS = -1
SEARCHES = {1: 'greedy', 4: 'beam 4'}


def random_sources(batch: int, length: int, vocab: int, seed: int = 0):
  """[batch, length] int32: tokens in [4, vocab), then EOS (1)."""
  rng = np.random.default_rng(seed)
  rows = rng.integers(4, vocab, (batch, length)).astype(np.int32)
  rows[:, -1] = 1
  return rows


def synthetic_vocabulary(size: int) -> list[str]:
  """Pieces for ids without a tokenizer: jaxformer's specials, then p4..."""
  return ['<pad>', '</s>', '<unk>', '<s>'] + [f'p{i}' for i in range(4, size)]


def timed(fn):
  """(wall seconds, process CPU seconds) of one call."""
  start, start_cpu = time.perf_counter(), time.process_time()
  jax.block_until_ready(fn())
  return time.perf_counter() - start, time.process_time() - start_cpu


class Engines:
  """One callable per engine and search, all decoding `rows` to exactly
  `length` tokens per sentence: `runs[engine, search]`, and `tokens[search]`
  the output tokens of one call."""

  def __init__(self, params, config, rows, vocabulary, length, threads,
               batch_parts, names, directory):
    self.runs = {}
    self.tokens = {s: rows.shape[0] * length for s in SEARCHES.values()}
    source = [[vocabulary[t] for t in row[row != 0][:-1]] for row in rows]
    if 'jaxformer' in names:
      for beam in (1, 4):
        self.runs['jaxformer', SEARCHES[beam]] = self._jaxformer(
            params, config, rows, length, beam, batch_parts)
    for name, quantization in (('ct2', None), ('ct2_int8', 'int8')):
      if name in names:
        import ctranslate2
        from jaxformer.interop import ct2
        folder = os.path.join(directory, name)
        ct2.write(params, config, vocabulary, vocabulary, '<unk>', folder,
                  quantization)
        translator = ctranslate2.Translator(
            folder, device='cpu', compute_type=quantization or 'float32',
            inter_threads=1, intra_threads=threads)
        for beam in (1, 4):
          self.runs[name, SEARCHES[beam]] = (
              lambda t=translator, b=beam: t.translate_batch(
                  source, beam_size=b, max_decoding_length=length,
                  min_decoding_length=length, max_batch_size=len(source)))
    if 'torch' in names:
      import torch
      from jaxformer.interop import hf_marian
      torch.set_num_threads(threads)
      model = hf_marian.marian_model(params, config)
      ids = torch.from_numpy(rows.astype(np.int64))
      mask = torch.from_numpy((rows != 0).astype(np.int64))

      def generate(beam):
        with torch.inference_mode():
          return model.generate(
              input_ids=ids, attention_mask=mask, num_beams=beam,
              do_sample=False, max_new_tokens=length,
              min_new_tokens=length)
      for beam in (1, 4):
        self.runs['torch', SEARCHES[beam]] = lambda b=beam: generate(b)

  @staticmethod
  def _jaxformer(params, config, rows, length, beam, parts):
    if beam == 1:
      return lambda: search.greedy_decode(
          params, config, rows, max_decode_len=length, eos_id=NO_EOS,
          batch_parts=parts)
    return lambda: beam_search.beam_search(
        params, config, rows, beam_size=beam, max_decode_len=length,
        eos_id=NO_EOS, batch_parts=parts)


def race(engines, rounds: int, label: str) -> list[dict]:
  """Alternating rounds of every engine, one search (`engines.tokens`'
  keys, in order) after the other; prints one line per engine and search
  and returns its figures. engines: `Engines` or `LlamaEngines`."""
  figures = []
  for search_name, output_tokens in engines.tokens.items():
    names = [n for n, s in engines.runs if s == search_name]
    run = lambda n: timed(engines.runs[n, search_name])  # noqa: E731
    first = {n: run(n)[0] for n in names}  # Warm up.
    walls = {n: [] for n in names}
    cpus = {n: [] for n in names}
    for _ in range(rounds):
      for n in names:
        wall, cpu = run(n)
        walls[n].append(wall)
        cpus[n].append(cpu)
    anchor = float(np.median(walls['jaxformer'])) if 'jaxformer' in walls \
        else None
    for n in names:
      wall = float(np.median(walls[n]))
      ratio = f'{anchor / wall:5.2f}x jaxformer' if anchor else ''
      extra = (f', compile {first[n] - wall:.1f} s' if n == 'jaxformer'
               else '')
      print(f'| {label} | {search_name} | {n} | {output_tokens / wall:7.0f} | '
            f'{wall * 1e3:7.0f} | {float(np.median(cpus[n])) * 1e3:7.0f} | '
            f'{ratio}{extra} |', flush=True)
      figures.append({'model': label, 'search': search_name, 'engine': n,
                      'output_tokens_per_s': output_tokens / wall,
                      'batch_s': wall, 'compile_s': first[n] - wall})
  return figures


# A Llama of a realistic small size, in Hugging Face `LlamaConfig`'s terms:
# GQA (8 query heads, 2 key/value heads), SwiGLU, RMSNorm, RoPE, untied head.
LLAMA = dict(vocab_size=32000, hidden_size=512, num_attention_heads=8,
             num_key_value_heads=2, intermediate_size=1408,
             num_hidden_layers=8, max_position_embeddings=512,
             tie_word_embeddings=False)
INTEROP_TESTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..',
                             'tests', 'interop')


def llama_folder(folder: str) -> None:
  """A random-weight Hugging Face Llama of `LLAMA` (transformers' own
  initialisation) saved in `folder` with the Llama 3 style tokenizer of
  tests/interop/hf_tokenizer_folders.py (500 pieces and its specials; the
  ids beyond them pad the vocabulary, as hubs pad it)."""
  import sys
  import torch
  import transformers
  sys.path.insert(0, INTEROP_TESTS)
  import hf_tokenizer_folders
  facts = hf_tokenizer_folders.write_llama3(folder)
  config = transformers.LlamaConfig(
      bos_token_id=facts['bos_id'], eos_token_id=facts['eos_ids'],
      pad_token_id=facts['pad_id'], **LLAMA)
  torch.manual_seed(0)
  transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)


class LlamaEngines:
  """`Engines` of the imported Llama: greedy continuations of fixed random
  prompts (BOS, then `prompt_len - 1` ids of the tokenizer's pieces) by
  exactly `length` new tokens each, in batches of each of `batches`. The
  folder goes through `jaxformer import`, and `jaxformer export --format
  ct2` (with --quantization int8 for ct2_int8) makes CTranslate2's models.
  jaxformer runs `generation.generate_ids` (the search behind `jaxformer
  generate`, without its text I/O); 'jaxformer_stepwise' is the decoding
  loop without prefill, the prompt fed one token per step
  (tests/interop/llama_folders.py's `our_greedy`)."""

  def __init__(self, directory, prompt_len, length, batches, threads, names):
    import sys
    from jaxformer.checkpoints import trained
    from jaxformer.cli import main as cli
    from jaxformer.inference import generation
    from jaxformer.interop import ct2_lm
    sys.path.insert(0, INTEROP_TESTS)
    import llama_folders
    folder, ours = (os.path.join(directory, n) for n in ('hf', 'jaxformer'))
    llama_folder(folder)
    assert cli.main(['import', '--from', folder, '--out', ours]) == 0
    model = trained.load(ours)
    params, config = model.params, model.model_config
    pieces = ct2_lm.vocabulary(model.target_tok, config.vocab_size)
    rng = np.random.default_rng(0)
    prompts = [[config.decoder_start_id] + rng.integers(
        4, 400, prompt_len - 1).tolist() for _ in range(max(batches))]
    self.runs, self.tokens = {}, {}
    for batch in batches:
      label, rows = f'greedy, batch {batch}', prompts[:batch]
      self.tokens[label] = batch * length
      if 'jaxformer' in names:
        self.runs['jaxformer', label] = (
            lambda r=rows: generation.generate_ids(
                params, config, r, max_new_tokens=length, eos_ids=()))
      if 'jaxformer_stepwise' in names:
        self.runs['jaxformer_stepwise', label] = (
            lambda r=rows: llama_folders.our_greedy(params, config, r, length,
                                                    ()))
    for name, quantization in (('ct2', None), ('ct2_int8', 'int8')):
      if name in names:
        self._ct2(name, quantization, ours, directory, prompts, pieces,
                  batches, length, threads, cli)
    if 'torch' in names:
      self._torch(folder, prompts, batches, length, threads)

  def _ct2(self, name, quantization, ours, directory, prompts, pieces,
           batches, length, threads, cli):
    import ctranslate2
    out = os.path.join(directory, name)
    assert cli.main(['export', '--workdir', ours, '--format', 'ct2', '--out',
                     out] + (['--quantization', quantization]
                             if quantization else [])) == 0
    generator = ctranslate2.Generator(
        out, device='cpu', compute_type=quantization or 'float32',
        inter_threads=1, intra_threads=threads)
    tokens = [[pieces[i] for i in p] for p in prompts]
    check = generator.generate_batch(tokens[:1], max_length=length,
                                     min_length=length, sampling_topk=1,
                                     include_prompt_in_result=False)
    assert len(check[0].sequences_ids[0]) == length, 'max_length counts'
    for batch in batches:
      self.runs[name, f'greedy, batch {batch}'] = (
          lambda t=tokens[:batch]: generator.generate_batch(
              t, max_length=length, min_length=length, sampling_topk=1,
              beam_size=1, include_prompt_in_result=False,
              max_batch_size=len(t)))

  def _torch(self, folder, prompts, batches, length, threads):
    import torch
    import transformers
    torch.set_num_threads(threads)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32).eval()
    ids = torch.tensor(prompts)

    def generate(batch):
      with torch.inference_mode():
        return model.generate(
            input_ids=ids[:batch], attention_mask=torch.ones_like(ids[:batch]),
            do_sample=False, max_new_tokens=length, min_new_tokens=length)
    for batch in batches:
      self.runs['torch', f'greedy, batch {batch}'] = (
          lambda b=batch: generate(b))


def trained_model(workdir: str, batch: int):
  """(params, config, rows [batch, s], vocabulary, test sentences) of a
  trained run's test split."""
  from jaxformer.inference import evaluate
  from jaxformer.checkpoints import trained
  from jaxformer.data import sources
  model = trained.load(workdir)
  pairs = sources.read_split(model.config.data, 'test')
  rows, _ = evaluate.encode_sources(model.source_tok,
                                    [s for s, _ in pairs[:batch]],
                                    model.config.data.max_source_length)
  vocabulary = [model.source_tok.id_to_piece(i)
                for i in range(model.model_config.vocab_size)]
  return model, rows, vocabulary, [s for s, _ in pairs]


def exactness(model, sentences, directory: str) -> None:
  """How many greedy outputs of the CTranslate2 exports (float32, int8)
  equal jaxformer's, on a trained model's test sentences."""
  import ctranslate2
  from jaxformer.inference import evaluate
  from jaxformer.interop import ct2
  config = model.model_config
  rows, _ = evaluate.encode_sources(model.source_tok, sentences,
                                    model.config.data.max_source_length)
  length = search.max_decode_length(rows, model.config.decode.max_extra_len,
                                    config.max_len)
  ours = np.asarray(search.greedy_decode(model.params, config, rows,
                                         max_decode_len=length))
  ours = [[int(t) for t in row[:list(row).index(config.eos_id)]]
          if config.eos_id in row else [int(t) for t in row] for row in ours]
  source = [[model.source_tok.id_to_piece(t) for t in row[row != 0][:-1]]
            for row in rows]
  ids = {model.target_tok.id_to_piece(i): i
         for i in range(model.target_tok.vocab_size)}
  for quantization in (None, 'int8'):
    out = ct2.export(model, os.path.join(directory, f'exact_{quantization}'),
                     quantization)
    results = ctranslate2.Translator(
        out, compute_type=quantization or 'float32').translate_batch(
            source, beam_size=1, max_decoding_length=length)
    theirs = [[ids[p] for p in r.hypotheses[0]] for r in results]
    same = sum(a == b for a, b in zip(ours, theirs))
    print(f'CTranslate2 {quantization or "float32"} greedy outputs equal to '
          f"jaxformer's: {same}/{len(ours)} test sentences", flush=True)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--models', default='quickstart,base')
  parser.add_argument('--engines', default='jaxformer,ct2,ct2_int8,torch')
  parser.add_argument('--workdir', default=None,
                      help="a trained quick start run: the 'quickstart' "
                      'weights and test sentences')
  parser.add_argument('--batch', type=int, default=8)
  parser.add_argument('--source_len', type=int, default=32)
  parser.add_argument('--output_len', type=int, default=64)
  parser.add_argument('--rounds', type=int, default=5)
  parser.add_argument('--threads', type=int,
                      default=len(os.sched_getaffinity(0)),
                      help="each engine's threads (jaxformer: the CPUs)")
  parser.add_argument('--batch_parts', type=int, default=None,
                      help='default: cpu_kernels.default_batch_parts')
  parser.add_argument('--json', help='also write the figures to this file')
  args = parser.parse_args()
  names = args.engines.split(',')
  cpus = sorted(os.sched_getaffinity(0))
  if args.threads < len(cpus):  # XLA's CPU threads follow the process's CPUs.
    os.sched_setaffinity(0, cpus[:args.threads])
  print(f'{jax.devices()[0].platform}, {args.threads} threads; batch '
        f'{args.batch}, {args.output_len} output tokens per sentence (EOS '
        f'off); load average {os.getloadavg()[0]:.1f}\n\n'
        '| model | search | engine | output tokens/s | ms per batch | '
        'ms CPU | ratio |\n|---|---|---|---:|---:|---:|---|', flush=True)
  figures = []
  with tempfile.TemporaryDirectory() as directory:
    trained = None
    for label in args.models.split(','):
      if label == 'llama':
        engines = LlamaEngines(os.path.join(directory, label),
                               args.source_len, args.output_len,
                               (1, args.batch), args.threads, names)
        figures.extend(race(engines, args.rounds, 'llama (imported)'))
        continue
      config = MODELS[label]
      if label == 'quickstart' and args.workdir:
        trained, rows, vocabulary, _ = trained_model(args.workdir, args.batch)
        params, config = trained.params, trained.model_config
        label = 'quickstart (trained)'
      else:
        rows = random_sources(args.batch, args.source_len, config.vocab_size)
        params = EncoderDecoder(config).init(jax.random.PRNGKey(0), rows,
                                             rows)['params']
        vocabulary = synthetic_vocabulary(config.vocab_size)
      parts = args.batch_parts or cpu_kernels.default_batch_parts(
          jnp.asarray(rows))
      engines = Engines(params, config, rows, vocabulary, args.output_len,
                        args.threads, parts, names,
                        os.path.join(directory, label.split()[0]))
      figures.extend(race(engines, args.rounds, label))
    print(f'load average {os.getloadavg()[0]:.1f}')
    if args.json:
      with open(args.json, 'w') as f:
        json.dump({'device': jax.devices()[0].device_kind,
                   'batch': args.batch, 'output_len': args.output_len,
                   'runs': figures}, f, indent=2)
    if trained is not None and 'ct2' in names:
      from jaxformer.data import sources
      exactness(trained, [s for s, _ in sources.read_split(
          trained.config.data, 'test')], directory)


if __name__ == '__main__':
  main()
