"""Input: data sources, SentencePiece tokenizers and the tf.data pipeline
(`jaxformer.data.pipeline`, with `packing`, `bucketing`, `batch_layout` and
`epochs`: the modules here that import TensorFlow)."""
