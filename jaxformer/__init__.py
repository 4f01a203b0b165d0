"""jaxformer: the Transformer of "Attention Is All You Need" in JAX and Flax."""
__version__ = '0.1.0'
