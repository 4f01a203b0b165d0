"""Models in and out of other formats: CTranslate2 and Hugging Face Marian.

`transformers`, `torch` and `ctranslate2` are imported only inside these
modules, and only by the function that needs them.
"""
