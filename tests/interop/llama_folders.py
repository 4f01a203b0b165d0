"""Random-weight Hugging Face Llama-family folders built offline: a model of
`LlamaConfig`, `Qwen2Config` or `MistralConfig` with weights drawn here
(every tensor, norms around 1, so that a mapping error shows), saved with
`save_pretrained` beside a tokenizer folder of hf_tokenizer_folders.py; and
the two sides' logits and greedy continuations."""
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

import hf_tokenizer_folders
from jaxformer.inference import search
from jaxformer.model import incremental
from jaxformer.model.transformer import DecoderLM

LLAMA3_ROPE = {'rope_type': 'llama3', 'factor': 8.0, 'low_freq_factor': 1.0,
               'high_freq_factor': 4.0, 'original_max_position_embeddings': 32}
# name -> (tokenizer folder, config class, its arguments, how it is saved).
SHAPES = {
    # GQA, llama3 rope scaling, untied head; saved in shards of 40 KB.
    'llama3-gqa-untied-sharded': ('llama3-bytelevel', 'LlamaConfig', dict(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=96, num_hidden_layers=2, max_position_embeddings=256,
        rope_parameters=dict(LLAMA3_ROPE, rope_theta=500000.0),
        tie_word_embeddings=False), dict(max_shard_size='40KB')),
    # MQA, q/k/v biases, tied head, no rope scaling; saved in bfloat16.
    'qwen2-mqa-tied-bf16': ('qwen2-bytelevel', 'Qwen2Config', dict(
        hidden_size=48, num_attention_heads=4, num_key_value_heads=1,
        intermediate_size=80, num_hidden_layers=2, max_position_embeddings=512,
        rope_parameters={'rope_type': 'default', 'rope_theta': 1e6},
        tie_word_embeddings=True), dict(bf16=True)),
    # head_dim != hidden / heads, linear rope scaling, no sliding window.
    'mistral-head-dim-linear': ('mistral-sentencepiece', 'MistralConfig', dict(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=64, num_hidden_layers=2,
        max_position_embeddings=256, sliding_window=None,
        rope_parameters={'rope_type': 'linear', 'factor': 2.0,
                         'rope_theta': 10000.0},
        tie_word_embeddings=False), {}),
    # Multi-head, tied, biases on every projection, GeGLU.
    'llama2-biased-geglu-tied': ('llama2-sentencepiece', 'LlamaConfig', dict(
        hidden_size=32, num_attention_heads=2, num_key_value_heads=2,
        intermediate_size=48, num_hidden_layers=1, max_position_embeddings=128,
        attention_bias=True, mlp_bias=True, hidden_act='gelu_pytorch_tanh',
        tie_word_embeddings=True), {}),
}


def _randomize(model, seed: int) -> None:
  """Every weight drawn anew: matrices N(0, 1/fan_in), embeddings N(0,
  0.09), biases N(0, 0.01), norm scales N(1, 0.01)."""
  import torch
  generator = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, tensor in model.named_parameters():
      noise = torch.randn(tensor.shape, generator=generator)
      if name.endswith('norm.weight'):
        tensor.copy_(1 + 0.1 * noise)
      elif name.endswith('bias'):
        tensor.copy_(0.1 * noise)
      elif 'embed_tokens' in name or name == 'lm_head.weight':
        tensor.copy_(0.3 * noise)
      else:
        tensor.copy_(noise / tensor.shape[1] ** 0.5)


def write_folder(folder: str, name: str, seed: int = 0) -> dict:
  """Writes the folder of SHAPES[name]; returns what it holds:
  {'tokenizer': the tokenizer folder's facts (eos_ids, bos_id, ...),
  'config': the transformers config}."""
  import torch
  import transformers
  tokenizer_name, config_class, arguments, saving = SHAPES[name]
  facts = hf_tokenizer_folders.FOLDERS[tokenizer_name](folder)
  tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
  vocab_size = -(-len(tokenizer) // 16) * 16 + 16  # Padded, as hubs do.
  eos = facts['eos_ids']
  config = getattr(transformers, config_class)(
      vocab_size=vocab_size, bos_token_id=facts['bos_id'],
      eos_token_id=eos[0] if len(eos) == 1 else eos,
      pad_token_id=facts['pad_id'], **arguments)
  torch.manual_seed(seed)
  model = transformers.AutoModelForCausalLM.from_config(config).eval()
  _randomize(model, seed)
  model.generation_config.update(eos_token_id=eos, pad_token_id=facts['pad_id'],
                                 bos_token_id=facts['bos_id'])
  if saving.get('bf16'):
    model = model.to(torch.bfloat16)
  model.save_pretrained(folder, max_shard_size=saving.get('max_shard_size',
                                                          '5GB'))
  return {'tokenizer': facts, 'config': config}


def hf_model(folder: str):
  """The folder's model in float32 (bfloat16 weights widened), eval mode."""
  import torch
  from transformers import AutoModelForCausalLM
  return AutoModelForCausalLM.from_pretrained(folder,
                                              dtype=torch.float32).eval()


def hf_logits(model, rows: np.ndarray) -> np.ndarray:
  """[b, t] ids -> [b, t, vocab]: logits of the next token at each."""
  import torch
  with torch.no_grad():
    return model(input_ids=torch.tensor(rows, dtype=torch.long)).logits.numpy()


@functools.partial(jax.jit, static_argnames=('config',))
def _logits(params, rows, config):
  ones = jnp.ones_like(rows)
  positions = jnp.broadcast_to(jnp.arange(rows.shape[1]), rows.shape)
  return DecoderLM(config).apply({'params': params}, rows, ones, positions,
                                 method='decode_logits')


def our_logits(params, config, rows: np.ndarray) -> np.ndarray:
  """The same from `DecoderLM`: the rows are its inputs as they are (no
  start token), at positions 0..t-1."""
  return np.asarray(_logits(params, np.asarray(rows, np.int32), config))


def hf_greedy(model, prompt: list[int], new_tokens: int) -> list[int]:
  """`generate(do_sample=False)`'s tokens after the prompt (to EOS)."""
  import torch
  with torch.no_grad():
    out = model.generate(input_ids=torch.tensor([prompt]), do_sample=False,
                         max_new_tokens=new_tokens,
                         attention_mask=torch.ones(1, len(prompt),
                                                   dtype=torch.long))
  return out[0, len(prompt):].tolist()


@functools.partial(jax.jit, static_argnames=('config', 'length'))
def _greedy_tokens(params, prompts, lengths, config, length):
  """jaxformer's cached decoding loop, each row starting from its prompt's
  first token (the model then sees the prompt as Hugging Face does), the
  rest of the prompt forced, then the argmax; never stopping early."""
  width = prompts.shape[1]

  def choose(logits, step):
    forced = jnp.take(prompts, jnp.minimum(step + 1, width - 1), axis=1)
    return jnp.where(step + 1 < lengths, forced, search.greedy_choice(logits))

  cache = incremental.init_lm_cache(config, params, prompts.shape[0], length)
  tokens, _ = search.token_loop(
      incremental.lm_step_fn(config, params), choose, cache,
      jnp.zeros(prompts.shape[0], bool), length, -1, start_id=prompts[:, 0],
      pad_id=config.pad_id)
  return tokens


def our_greedy(params, config, prompts: list[list[int]], new_tokens: int,
               eos_ids) -> list[list[int]]:
  """The greedy continuation of each prompt (one batch, prompts of
  different lengths), up to and including the first of `eos_ids`."""
  width = max(map(len, prompts))
  rows = np.full((len(prompts), width), config.pad_id, np.int32)
  for row, prompt in zip(rows, prompts):
    row[:len(prompt)] = prompt
  tokens = np.asarray(_greedy_tokens(
      params, rows, np.array(list(map(len, prompts)), np.int32), config,
      width - 1 + new_tokens))
  return [up_to_eos(row[len(p) - 1:len(p) - 1 + new_tokens], eos_ids)
          for row, p in zip(tokens, prompts)]


def up_to_eos(ids, eos_ids) -> list[int]:
  ids = [int(t) for t in ids]
  ends = [i for i, t in enumerate(ids) if t in eos_ids]
  return ids[:ends[0] + 1] if ends else ids


def prompts(tokenizer, count: int = 6, seed: int = 3) -> list[list[int]]:
  """Token ids of short texts of different lengths (BOS as the model's
  tokenizer adds it)."""
  texts = hf_tokenizer_folders.training_texts(count, seed)
  rows = tokenizer.encode([t[:12 + 9 * i] for i, t in enumerate(texts)])
  # Without the EOS a Mistral-style tokenizer appends.
  return [ids[:-1] if ids[-1] == tokenizer.eos_id else ids for ids in rows]
