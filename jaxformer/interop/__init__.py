"""Other frameworks' models in and out of jaxformer (Hugging Face Marian,
the PyTorch reference Transformer). Imported only by the commands."""
