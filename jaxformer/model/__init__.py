"""Functional Flax Transformer models."""
from jaxformer.model.config import ModelConfig, base, big, from_config_dict
from jaxformer.model.transformer import (DecoderLM, EncoderClassifier,
                                         EncoderDecoder, EncoderRegressor,
                                         shift_right)
