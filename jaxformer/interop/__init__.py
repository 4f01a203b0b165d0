"""Other frameworks' models in and out of jaxformer (Hugging Face Marian,
CTranslate2, the PyTorch reference Transformer). Imported only by the
commands; `transformers`, `torch` and `ctranslate2` only inside the
functions that need them."""
