"""Pictures: a cross-attention heatmap of one translation and training
curves from metrics.jsonl. matplotlib without a display (Agg)."""
import io
import os

import matplotlib

matplotlib.use('Agg')
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from jaxformer.storage import paths


def attention_heatmap(weights: np.ndarray, source_pieces: list[str],
                      target_pieces: list[str], out_path: str,
                      title: str = '') -> None:
  """Saves a heatmap of attention `weights` [target, source] with the
  generated target subwords down and the source subwords across."""
  height = max(3.0, 0.35 * len(target_pieces) + 1.5)
  width = max(4.0, 0.35 * len(source_pieces) + 2.0)
  fig, ax = plt.subplots(figsize=(width, height), dpi=100)
  image = ax.imshow(weights, cmap='viridis', aspect='auto', vmin=0.0)
  ax.set_xticks(range(len(source_pieces)), source_pieces, rotation=90)
  ax.set_yticks(range(len(target_pieces)), target_pieces)
  ax.set_xlabel('source subwords')
  ax.set_ylabel('generated target subwords')
  if title:
    ax.set_title(title)
  fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
  fig.tight_layout()
  _save(fig, out_path)


def training_curves(records: list[dict], out_path: str,
                    keys: tuple[str, ...] = ('loss', 'eval_loss', 'eval_bleu',
                                             'learning_rate')) -> None:
  """Saves one panel per metric present in `records` (metrics.jsonl rows)."""
  present = [k for k in keys if any(k in r for r in records)]
  if not present:
    raise ValueError(f'None of {keys} appear in the metrics.')
  fig, axes = plt.subplots(len(present), 1, figsize=(7, 2.4 * len(present)),
                           sharex=True, squeeze=False)
  for ax, key in zip(axes[:, 0], present):
    points = [(r['step'], r[key]) for r in records if key in r]
    steps, values = zip(*points)
    ax.plot(steps, values, marker='.' if len(points) < 30 else None)
    ax.set_ylabel(key)
    ax.grid(alpha=0.3)
  axes[-1, 0].set_xlabel('step')
  fig.tight_layout()
  _save(fig, out_path)


def _save(fig, out_path: str) -> None:
  """Writes the figure in the format of the name's suffix (local or gs://)."""
  image = io.BytesIO()
  suffix = os.path.splitext(out_path)[1].lstrip('.').lower() or 'png'
  fig.savefig(image, format=suffix)
  plt.close(fig)
  paths.write_bytes(out_path, image.getvalue())
