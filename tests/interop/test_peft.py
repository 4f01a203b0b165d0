"""Hugging Face PEFT LoRA adapters in and out of Llama-family models:
`jaxformer import --from BASE --adapter PEFT_DIR` computes PeftModel's
logits (within 2e-5, float32) and greedy ids; `export --format peft`
gives a folder `PeftModel.from_pretrained` loads with the same logits, and
that imports again bitwise; `--format hf` writes the merged model.
Adapters are made by `peft` itself over random-weight bases
(llama_folders.py), with non-zero lora_B, ranks 4 and 8, different
targets, rsLoRA on and off.
Bad adapters fail with one line, leaving nothing at --out."""
import json
import os

import jax
import numpy as np
import pytest

torch = pytest.importorskip('torch')
pytest.importorskip('transformers')
peft = pytest.importorskip('peft')

import llama_folders  # noqa: E402

from jaxformer.checkpoints import trained  # noqa: E402
from jaxformer.cli import main as cli  # noqa: E402

NEW_TOKENS = 10
# Float32 logits of magnitude ~6 summed in two orders: a few ulps each
# (1.05e-5 seen with transformers 5.25 against PyTorch's CPU kernels).
LOGITS_WITHIN = 2e-5
# name -> (base shape, LoraConfig arguments).
ADAPTERS = {
    'llama3-qv-r4': ('llama3-gqa-untied-sharded', dict(
        r=4, lora_alpha=8, target_modules=['q_proj', 'v_proj'])),
    'qwen2-all-r8-rslora': ('qwen2-mqa-tied-bf16', dict(
        r=8, lora_alpha=16, use_rslora=True, target_modules=[
            'q_proj', 'k_proj', 'v_proj', 'o_proj', 'gate_proj', 'up_proj',
            'down_proj'])),
    'mistral-ffn-o-r4': ('mistral-head-dim-linear', dict(
        r=4, lora_alpha=12, target_modules=['o_proj', 'gate_proj',
                                            'down_proj'])),
}


def write_adapter(base_folder: str, folder: str, arguments: dict, seed=0):
  """A PEFT LoRA adapter over the base, every lora_B drawn non-zero,
  saved by save_pretrained; returns the PeftModel (float32, eval)."""
  base = llama_folders.hf_model(base_folder)
  model = peft.get_peft_model(base, peft.LoraConfig(
      task_type='CAUSAL_LM', lora_dropout=0.0, **arguments))
  generator = torch.Generator().manual_seed(seed)
  rank = arguments['r']
  scale = arguments['lora_alpha'] / (
      rank ** 0.5 if arguments.get('use_rslora') else rank)
  with torch.no_grad():
    for name, tensor in model.named_parameters():
      if 'lora_B' in name:  # scale * B of about 0.4 / sqrt(rank) each.
        tensor.copy_(0.4 / scale * torch.randn(tensor.shape,
                                               generator=generator))
  model.save_pretrained(folder)
  return model.eval()


class Adapted:
  """A base folder, a PEFT adapter over it, PEFT's model and our import."""

  def __init__(self, root, name):
    shape, arguments = ADAPTERS[name]
    self.base = str(root / shape)
    self.adapter = str(root / f'{name}-adapter')
    self.out = str(root / f'{name}-jaxformer')
    llama_folders.write_folder(self.base, shape)
    self.peft_model = write_adapter(self.base, self.adapter, arguments)
    assert cli.main(['import', '--from', self.base, '--adapter', self.adapter,
                     '--out', self.out]) == 0
    self.ours = trained.load(self.out)
    self.config = self.ours.model_config
    self.rows = np.random.RandomState(0).randint(
        0, self.config.vocab_size, (3, 12))


_ADAPTED = {}


def adapted_of(name: str, tmp_path_factory) -> Adapted:
  """One import per adapter for the module, whichever test asks."""
  if name not in _ADAPTED:
    _ADAPTED[name] = Adapted(tmp_path_factory.mktemp('peft'), name)
  return _ADAPTED[name]


@pytest.fixture(scope='module', params=sorted(ADAPTERS))
def adapted(request, tmp_path_factory):
  return adapted_of(request.param, tmp_path_factory)


def test_the_import_has_the_adapters_settings(adapted):
  _, arguments = ADAPTERS[os.path.basename(adapted.adapter)[:-len(
      '-adapter')]]
  lora = adapted.config.lora
  assert (lora.rank, lora.alpha, lora.use_rslora) == (
      arguments['r'], arguments['lora_alpha'],
      arguments.get('use_rslora', False))
  assert len(adapted.config.lora_targets) == len(arguments['target_modules'])


@pytest.mark.slow
def test_logits_equal_peft_within_2e_5_and_greedy_ids_equal(adapted):
  theirs = llama_folders.hf_logits(adapted.peft_model, adapted.rows)
  base = llama_folders.hf_logits(llama_folders.hf_model(adapted.base),
                                 adapted.rows)
  ours = llama_folders.our_logits(adapted.ours.params, adapted.config,
                                  adapted.rows)
  difference = np.abs(ours - theirs).max()
  print(f'{adapted.adapter}: max abs logit difference {difference:.3g}, '
        f'the adapter moves them by {np.abs(theirs - base).max():.3g}')
  assert np.abs(theirs - base).max() > 1e-2  # The adapter counts.
  assert difference < LOGITS_WITHIN
  tokenizer = adapted.ours.target_tok
  prompts = llama_folders.prompts(tokenizer, count=4)
  eos = list(tokenizer.eos_ids)
  greedy = [llama_folders.up_to_eos(llama_folders.hf_greedy(
      adapted.peft_model, p, NEW_TOKENS), eos) for p in prompts]
  assert llama_folders.our_greedy(adapted.ours.params, adapted.config,
                                  prompts, NEW_TOKENS, eos) == greedy


def test_peft_export_loads_in_peft_and_imports_again_bitwise(adapted,
                                                             tmp_path):
  out = str(tmp_path / 'peft')
  assert cli.main(['export', '--format', 'peft', '--from', adapted.out,
                   '--out', out]) == 0
  assert sorted(os.listdir(out)) == ['adapter_config.json',
                                     'adapter_model.safetensors']
  loaded = peft.PeftModel.from_pretrained(
      llama_folders.hf_model(adapted.base), out).eval()
  ours = llama_folders.our_logits(adapted.ours.params, adapted.config,
                                  adapted.rows)
  assert np.abs(llama_folders.hf_logits(loaded, adapted.rows) - ours
                ).max() < LOGITS_WITHIN
  again = str(tmp_path / 'again')
  assert cli.main(['import', '--from', adapted.base, '--adapter', out,
                   '--out', again]) == 0
  model = trained.load(again)
  assert model.model_config == adapted.config
  jax.tree.map(np.testing.assert_array_equal, model.params,
               adapted.ours.params)


def test_hf_export_is_the_merged_model(adapted, tmp_path):
  out = str(tmp_path / 'hf')
  assert cli.main(['export', '--format', 'hf', '--from', adapted.out,
                   '--out', out]) == 0
  merged = llama_folders.hf_model(out)
  theirs = llama_folders.hf_logits(adapted.peft_model, adapted.rows)
  assert np.abs(llama_folders.hf_logits(merged, adapted.rows) - theirs
                ).max() < 1e-4


def fails_with_one_line(argv, tmp_path, capsys, *words):
  out = tmp_path / 'out'
  capsys.readouterr()
  assert cli.main([*argv, '--out', str(out)]) == 1
  lines = capsys.readouterr().err.strip().splitlines()
  assert len(lines) == 1, lines
  for word in words:
    assert word in lines[0], lines[0]
  assert not out.exists()


@pytest.mark.parametrize('kind, config', [
    ('PREFIX_TUNING', dict(num_virtual_tokens=4)),
    ('IA3', dict(target_modules=['k_proj'], feedforward_modules=[]))])
def test_other_peft_types_are_refused_by_name(adapted, tmp_path, capsys,
                                              kind, config):
  folder = tmp_path / 'other'
  folder.mkdir()
  (folder / 'adapter_config.json').write_text(json.dumps(
      dict(peft_type=kind, task_type='CAUSAL_LM', **config)))
  fails_with_one_line(['import', '--from', adapted.base, '--adapter',
                       str(folder)], tmp_path, capsys, kind, 'LORA')


def test_an_adapter_of_another_base_names_the_tensor_and_both_shapes(
    tmp_path_factory, tmp_path, capsys):
  llama3 = adapted_of('llama3-qv-r4', tmp_path_factory)
  qwen2 = adapted_of('qwen2-all-r8-rslora', tmp_path_factory)
  fails_with_one_line(['import', '--from', qwen2.base, '--adapter',
                       llama3.adapter], tmp_path, capsys,
                      'base_model.model.model.layers.0.self_attn.q_proj.'
                      'lora_A.weight has shape (4, 64); this base wants '
                      '(4, 48)', 'another base')


def test_dora_is_refused(adapted, tmp_path, capsys):
  folder = tmp_path / 'dora'
  folder.mkdir()
  config = json.load(open(os.path.join(adapted.adapter,
                                       'adapter_config.json')))
  config['use_dora'] = True
  (folder / 'adapter_config.json').write_text(json.dumps(config))
  fails_with_one_line(['import', '--from', adapted.base, '--adapter',
                       str(folder)], tmp_path, capsys, 'use_dora=True')


@pytest.mark.slow
def test_generate_chat_continues_the_rendered_conversation(tmp_path_factory,
                                                          capsys):
  """`jaxformer generate --chat` on the Qwen2-style import (whose folder
  has a chat template): the greedy ids PEFT's model generates from
  apply_chat_template(..., add_generation_prompt=True)."""
  import transformers
  qwen2 = adapted_of('qwen2-all-r8-rslora', tmp_path_factory)
  messages = [{'role': 'user', 'content': 'Name a colour.'}]
  prompt = transformers.AutoTokenizer.from_pretrained(
      qwen2.base).apply_chat_template(messages, add_generation_prompt=True,
                                      tokenize=True, return_dict=True)
  expected = llama_folders.up_to_eos(llama_folders.hf_greedy(
      qwen2.peft_model, list(prompt['input_ids']), NEW_TOKENS),
      list(qwen2.ours.target_tok.eos_ids))
  capsys.readouterr()
  assert cli.main(['generate', '--workdir', qwen2.out, '--chat', '--prompt',
                   json.dumps({'messages': messages}), '--jsonl',
                   '--temperature', '0', '--max-new-tokens',
                   str(NEW_TOKENS)]) == 0
  record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert record['ids'] == expected
