"""Data: the embedded corpus, tokenizers, token sources, synthetic tasks, Grain pipelines."""
