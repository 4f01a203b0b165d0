"""jaxformer: the Transformer of "Attention Is All You Need" in JAX and Flax."""
import os

# TensorFlow serves only tf.data here; keep its start-up chatter quiet.
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
# TensorFlow >= 2.21 logs "oneDNN custom operations are on" at import
# whatever TF_CPP_MIN_LOG_LEVEL says; oneDNN speeds TF's own math kernels,
# which tf.data's gathers and shuffles do not use.
os.environ.setdefault('TF_ENABLE_ONEDNN_OPTS', '0')

__version__ = '0.1.0'
