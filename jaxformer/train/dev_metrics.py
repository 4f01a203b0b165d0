"""The encoder-only tasks' evaluation metrics, from every example's
prediction: accuracy and macro F1 (classification), Pearson and Spearman
correlations (regression), computed exactly in float64 on the host (the
loss sums of `loss.py` are float32 sums on the devices).

Each takes arrays over the real examples of a split: [examples] class ids,
or [examples, dim] values (a correlation is the mean of the dims' own).
"""
import numpy as np


def accuracy(predicted: np.ndarray, labels: np.ndarray) -> float:
  """The share of examples whose predicted class is the label."""
  return float(np.mean(np.asarray(predicted) == np.asarray(labels)))


def macro_f1(predicted: np.ndarray, labels: np.ndarray) -> float:
  """The unweighted mean over classes (those predicted or labelled) of
  F1 = 2 TP / (predicted + actual), as scikit-learn's f1_score(average=
  'macro')."""
  predicted, labels = np.asarray(predicted), np.asarray(labels)
  scores = [2 * np.sum((predicted == c) & (labels == c))
            / (np.sum(predicted == c) + np.sum(labels == c))
            for c in np.union1d(predicted, labels)]
  return float(np.mean(scores))


def average_ranks(x: np.ndarray) -> np.ndarray:
  """[n] float64 ranks from 1, ties sharing their mean rank (scipy's
  rankdata(method='average'))."""
  x = np.asarray(x, np.float64)
  order = np.argsort(x, kind='stable')
  _, first, counts = np.unique(x[order], return_index=True,
                               return_counts=True)
  ranks = np.empty(len(x))
  ranks[order] = np.repeat(first + (counts + 1) / 2, counts)
  return ranks


def pearson(x: np.ndarray, y: np.ndarray) -> float:
  """The correlation of [n] x and y; 0.0 if either is constant."""
  x = np.asarray(x, np.float64) - np.mean(x, dtype=np.float64)
  y = np.asarray(y, np.float64) - np.mean(y, dtype=np.float64)
  scale = np.sqrt(np.sum(x * x) * np.sum(y * y))
  return float(np.sum(x * y) / scale) if scale > 0 else 0.0


def spearman(x: np.ndarray, y: np.ndarray) -> float:
  """The correlation of the ranks of [n] x and y."""
  return pearson(average_ranks(x), average_ranks(y))


def class_metrics(rows: dict[str, np.ndarray]) -> dict[str, float]:
  """'accuracy' and 'macro_f1' of rows 'predicted' and 'labels'."""
  return {'accuracy': accuracy(rows['predicted'], rows['labels']),
          'macro_f1': macro_f1(rows['predicted'], rows['labels'])}


def value_metrics(rows: dict[str, np.ndarray]) -> dict[str, float]:
  """'pearson' and 'spearman' of rows 'predictions' and 'values' [n, dim]."""
  pairs = list(zip(np.asarray(rows['predictions']).T,
                   np.asarray(rows['values']).T))
  return {'pearson': float(np.mean([pearson(p, v) for p, v in pairs])),
          'spearman': float(np.mean([spearman(p, v) for p, v in pairs]))}
