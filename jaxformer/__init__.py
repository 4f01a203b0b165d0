"""jaxformer: the Transformer of "Attention Is All You Need" in JAX and Flax."""
import os

# TensorFlow serves only tf.data here; keep its start-up chatter quiet.
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
# TensorFlow >= 2.21 logs "oneDNN custom operations are on" at import
# whatever TF_CPP_MIN_LOG_LEVEL says, so every command's stderr began with
# it.  Without oneDNN the input pipeline starts a little slower (5M pairs,
# resumed at step 100,000: first batch 3.9-4.4 s instead of 3.0-3.6 s,
# benchmarks/input_pipeline.py); set TF_ENABLE_ONEDNN_OPTS=1 to keep it.
os.environ.setdefault('TF_ENABLE_ONEDNN_OPTS', '0')

# Before JAX starts its backend: XLA's CPU temporaries are then reused from
# step to step instead of faulted in afresh (host_memory.py).
from jaxformer.runtime import host_memory

host_memory.keep_freed_memory()

__version__ = '0.1.0'
