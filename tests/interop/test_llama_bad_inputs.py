"""What `jaxformer import` refuses of a Llama-family folder, and what the
exporters refuse: each bad input is one line naming the key or file (and
what is supported), exit 1, and nothing at --out."""
import json
import os
import shutil

import numpy as np
import pytest

pytest.importorskip('torch')
pytest.importorskip('transformers')
pytest.importorskip('safetensors')
pytest.importorskip('tokenizers')

import llama_folders  # noqa: E402

from jaxformer.checkpoints import trained  # noqa: E402
from jaxformer.cli import main as cli  # noqa: E402
from jaxformer.config.settings import default_config  # noqa: E402
from jaxformer.interop import ct2, ct2_lm, hf_llama, hf_marian  # noqa: E402
from jaxformer.model import ModelConfig  # noqa: E402
from jaxformer.train.tasks import get_task  # noqa: E402

SHARDED = 'llama3-gqa-untied-sharded'


@pytest.fixture(scope='module')
def good(tmp_path_factory):
  """Two folders: sharded and untied; one file and tied."""
  root = tmp_path_factory.mktemp('good')
  for name in (SHARDED, 'qwen2-mqa-tied-bf16'):
    llama_folders.write_folder(str(root / name), name)
  return root


def fails_with_one_line(argv, tmp_path, capsys, *words):
  out = tmp_path / 'out'
  capsys.readouterr()
  assert cli.main([*argv, '--out', str(out)]) == 1
  lines = capsys.readouterr().err.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith('jaxformer '), lines
  for word in words:
    assert word in lines[0], lines[0]
  assert not out.exists()
  assert not [p for p in os.listdir(tmp_path) if 'partial' in p]
  return lines[0]


def edit_json(path, change):
  data = json.loads(path.read_text())
  change(data)
  path.write_text(json.dumps(data))


def config(**changes):
  return lambda f: edit_json(f / 'config.json', lambda c: c.update(changes))


def truncate(path):
  path.write_bytes(path.read_bytes()[:3000])


def copy_tokenizer(other):
  """Another model's tokenizer files (a sibling folder of `f`)."""
  def damage(f):
    for name in ('tokenizer.json', 'tokenizer_config.json',
                 'generation_config.json'):
      shutil.copy(f.parent / other / name, f / name)
  return damage


SHARD = 'model-00003-of-00012.safetensors'
DAMAGES = {
    'unsupported-model-type': (config(model_type='gpt2'),
                               ("'gpt2'", 'marian, llama, qwen2, mistral')),
    'mistral-sliding-window': (
        config(model_type='mistral', sliding_window=64),
        ('sliding_window=64', 'max_position_embeddings')),
    'qwen2-sliding-window': (
        config(model_type='qwen2', use_sliding_window=True, sliding_window=64,
               max_window_layers=1),
        ('sliding_window=64',)),
    'moe': (config(num_local_experts=8, num_experts_per_tok=2),
            ('num_local_experts=8', 'num_experts_per_tok=2', 'experts')),
    'yarn': (lambda f: edit_json(f / 'config.json', lambda c: c[
        'rope_parameters'].update(rope_type='yarn')),
             ("'yarn'", 'default, linear, llama3')),
    'attention-bias-alone': (config(attention_bias=True),
                             ('attention_bias=True', 'mlp_bias')),
    'mlp-bias-alone': (config(mlp_bias=True), ('mlp_bias=True',)),
    'activation': (config(hidden_act='relu'),
                   ("hidden_act='relu'", 'silu')),
    'tied-but-lm-head-differs': (config(tie_word_embeddings=True),
                                 ('lm_head.weight', 'tie_word_embeddings')),
    'shape': (config(intermediate_size=100),
              ('mlp.gate_proj.weight has shape', '(100, 64)')),
    'no-tokenizer': (lambda f: (f / 'tokenizer.json').unlink(),
                     ('tokenizer.json',)),
    'mismatched-tokenizer': (copy_tokenizer('qwen2-mqa-tied-bf16'),
                             ('eos_token_id', 'do not belong')),
    'truncated-shard': (lambda f: truncate(f / SHARD), (SHARD, 'truncated')),
    'missing-shard': (lambda f: (f / SHARD).unlink(), (SHARD, 'missing')),
    'index-names-a-missing-file': (lambda f: edit_json(
        f / 'model.safetensors.index.json', lambda i: i['weight_map'].update(
            {'model.norm.weight': 'model-00099-of-00099.safetensors'})),
        ('model-00099-of-00099.safetensors', 'missing')),
    'no-weights': (lambda f: [p.unlink() for p in f.glob('model*')],
                   ('safetensors',)),
}


@pytest.mark.parametrize('name', DAMAGES)
def test_bad_folders_fail_with_one_line_leaving_nothing(name, good, tmp_path,
                                                        capsys):
  damage, words = DAMAGES[name]
  folder = tmp_path / 'folder'
  shutil.copytree(good / SHARDED, folder)
  (tmp_path / 'qwen2-mqa-tied-bf16').symlink_to(good / 'qwen2-mqa-tied-bf16')
  damage(folder)
  fails_with_one_line(['import', '--from', str(folder)], tmp_path, capsys,
                      *words)


def test_an_untied_config_needs_an_lm_head(good, tmp_path, capsys):
  folder = tmp_path / 'folder'
  shutil.copytree(good / 'qwen2-mqa-tied-bf16', folder)
  config(tie_word_embeddings=False)(folder)
  fails_with_one_line(['import', '--from', str(folder)], tmp_path, capsys,
                      'no lm_head.weight', 'tie_word_embeddings=false')


def test_a_bad_dtype_is_refused(good, tmp_path, capsys):
  fails_with_one_line(['import', '--from', str(good / SHARDED), '--dtype',
                       'float16'], tmp_path, capsys, '--dtype float16',
                      'float32, bfloat16')


def test_bfloat16_import_rounds_and_computes_in_bfloat16(good, tmp_path):
  import jax.numpy as jnp
  out = str(tmp_path / 'bf16')
  assert cli.main(['import', '--from', str(good / SHARDED), '--out', out,
                   '--dtype', 'bfloat16']) == 0
  model = trained.load(out)
  assert model.model_config.dtype == 'bfloat16'
  weights = llama_folders.hf_model(str(good / SHARDED)).state_dict()
  theirs = weights['model.embed_tokens.weight'].numpy()
  ours = np.asarray(model.params['embed']['embedding'])
  np.testing.assert_array_equal(  # Stored in bfloat16, read as float32.
      ours, theirs.astype(jnp.bfloat16).astype(np.float32))
  assert not np.array_equal(ours, theirs)


# ---------------------------------------------------------------- export ---

def language_model(**options):
  """A `Trained` language model of jaxformer's own (parameters unused:
  exporters refuse before reading them)."""
  config = ModelConfig(vocab_size=64, d_model=16, num_heads=2, d_ff=32,
                       num_encoder_layers=0, num_decoder_layers=1, **options)
  run = default_config()
  run.task = 'language_model'
  return trained.Trained(None, config, run, None, None, None,
                         get_task('language_model'))


@pytest.mark.parametrize('export', [hf_llama.export, ct2_lm.export],
                         ids=['hf', 'ct2'])
def test_a_language_model_not_of_the_family_is_refused(export, tmp_path):
  with pytest.raises(ValueError) as error:
    export(language_model(), str(tmp_path / 'out'))
  message = str(error.value)
  for option in ("model.norm_position='post'", "model.norm_type='layer'",
                 "model.position_embedding='sinusoidal'",
                 'model.scale_embedding=True', "model.activation='relu'"):
    assert option in message, message
  assert not os.listdir(tmp_path)


MODERN = dict(norm_type='rms', num_kv_heads=2, head_dim=16,
              position_embedding='rope', activation='swiglu')


def translation_model(**options):
  config = ModelConfig(vocab_size=64, d_model=16, num_heads=4, d_ff=32,
                       num_encoder_layers=1, num_decoder_layers=1,
                       sinusoid_layout='halves', layer_norm_epsilon=1e-5,
                       **options)
  run = default_config()
  return trained.Trained(None, config, run, None, None, None,
                         get_task('translation'))


@pytest.mark.parametrize('export, words', [
    (ct2.export, ("model.norm_type='rms'", 'model.num_kv_heads=2',
                  'model.head_dim=16', "model.position_embedding='rope'",
                  "model.activation='swiglu'")),
    (hf_marian.export, ("model.norm_type='rms'", 'model.num_kv_heads=2',
                        'model.head_dim=16', "'rope'", "'swiglu'")),
], ids=['ct2', 'hf'])
def test_marian_exporters_refuse_the_new_blocks_naming_each(export, words,
                                                            tmp_path):
  with pytest.raises(ValueError) as error:
    export(translation_model(**MODERN), str(tmp_path / 'out'))
  assert len(str(error.value).splitlines()) == 1
  for word in words:
    assert word in str(error.value), str(error.value)
  assert not os.listdir(tmp_path)
  assert ct2.blockers(translation_model().model_config) == []
