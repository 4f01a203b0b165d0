"""Input: data sources, SentencePiece tokenizers and the tf.data pipeline
(`jaxformer.data.pipeline`, the only module here that imports TensorFlow)."""
