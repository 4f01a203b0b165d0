"""The pictures (`inference/plots.py`): a cross-attention heatmap and
training curves, written in the format their name's suffix says. The
commands that draw them on a trained run (`attention`, `curves`) are
test_cli's and test_gcs's (slow tier)."""
import matplotlib.image
import numpy as np
import pytest

from jaxformer.inference import plots


def test_a_heatmap_is_a_png_that_grows_with_the_pieces(tmp_path):
  weights = np.random.default_rng(0).dirichlet(np.ones(5), size=3)
  small, large = tmp_path / 'small.png', tmp_path / 'large.png'
  plots.attention_heatmap(weights, list('abcde'), ['x', 'y', '</s>'],
                          str(small), title='one sentence')
  wide = np.tile(weights, (4, 4)) / 4  # [12 targets, 20 sources]
  plots.attention_heatmap(wide, list('abcde') * 4, ['t'] * 12, str(large))
  small_image = matplotlib.image.imread(small)
  large_image = matplotlib.image.imread(large)
  assert small.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
  assert large_image.shape[0] > small_image.shape[0]
  assert large_image.shape[1] > small_image.shape[1]


def test_curves_draw_the_metrics_present_in_the_suffixs_format(tmp_path):
  records = [{'step': s, 'loss': 5.0 / s, 'learning_rate': 1e-3}
             for s in range(1, 6)] + [{'step': 5, 'eval_loss': 1.5}]
  one_panel, three_panels = tmp_path / 'one.png', tmp_path / 'three.png'
  plots.training_curves(records, str(one_panel), keys=('loss',))
  plots.training_curves(records, str(three_panels))  # eval_bleu is absent.
  assert (matplotlib.image.imread(three_panels).shape[0]
          == 3 * matplotlib.image.imread(one_panel).shape[0])
  svg = tmp_path / 'three.svg'
  plots.training_curves(records, str(svg))
  assert svg.read_text().lstrip().startswith('<?xml')
  with pytest.raises(ValueError, match='None of .*eval_bleu.* appear'):
    plots.training_curves(records, str(tmp_path / 'none.png'),
                          keys=('eval_bleu',))
