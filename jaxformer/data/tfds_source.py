"""A TensorFlow Datasets translation dataset as a split's pairs
(`data.source='tfds'`), already prepared or prepared now."""

from __future__ import annotations

from collections.abc import Iterator

import ml_collections

from jaxformer.data import input_errors


def _tfds_builder(settings: ml_collections.ConfigDict):
  import tensorflow_datasets as tfds  # Deferred: slow to import.
  try:
    return tfds.builder(settings.name, data_dir=settings.data_dir)
  except tfds.core.registered.DatasetNotFoundError:
    raise input_errors.DataError(
        f'unknown tfds dataset {settings.name!r} (data.tfds.name); use a name '
        "from https://www.tensorflow.org/datasets/catalog, e.g. "
        "'wmt14_translate/de-en'") from None


def _prepare_tfds(builder, settings: ml_collections.ConfigDict) -> None:
  if builder.is_prepared():
    return
  try:
    builder.download_and_prepare()
  except Exception as e:  # Download and build errors come in many types.
    raise input_errors.DataError(
        f'tfds dataset {settings.name!r} is not prepared in {builder.data_dir} '
        f'and preparing it failed ({type(e).__name__}: {e}); run `tfds build '
        f'{settings.name} --data_dir=DIR` on a machine with internet access '
        'and set data.tfds.data_dir=DIR') from None


def read(data_config: ml_collections.ConfigDict, split: str
               ) -> Iterator[input_errors.Pair]:
  """The split's pairs, read 4,096 at a time (never the whole split)."""
  settings = data_config.tfds
  builder = _tfds_builder(settings)
  languages = (settings.source_language, settings.target_language)
  available = tuple(builder.info.features.keys())
  if not set(languages) <= set(available):
    raise input_errors.DataError(
        f'tfds dataset {settings.name!r} has features {available}, not '
        f'{languages}; set data.tfds.source_language/target_language to two '
        'of them')
  _prepare_tfds(builder, settings)
  tfds_split = settings[f'{split}_split']
  try:
    dataset = builder.as_dataset(split=tfds_split)
  except (ValueError, KeyError) as e:
    raise input_errors.DataError(
        f'tfds dataset {settings.name!r} has no split {tfds_split!r} ({e}); '
        f'set data.tfds.{split}_split') from None
  pairs = dataset.map(lambda example: tuple(example[lang] for lang in languages))
  for source_batch, target_batch in pairs.batch(4096).as_numpy_iterator():
    yield from ((source.decode(), target.decode())
                for source, target in zip(source_batch, target_batch))
