"""Training the default model the course ships (data/models/pydoc-llama), from scratch, on any machine.

    __main__.py   the command: `python -m llmlab.train --out data/models/pydoc-llama --overwrite`
    corpus.py     the training text: the documentation every CPython installation carries, split train / held out
    tokenizer.py  a byte-level BPE tokenizer trained on it (the Hugging Face `tokenizers` library)
    trainer.py    the loop: next-token cross-entropy on packed windows, AdamW, cosine learning rate
    export.py     the Hugging Face folder: weights, config, tokenizer and model card, checked by reloading
"""
