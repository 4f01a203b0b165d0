"""jaxformer: the Transformer of "Attention Is All You Need" in JAX and Flax."""
import os

# TensorFlow serves only tf.data here; keep its start-up chatter quiet.
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')

__version__ = '0.1.0'
