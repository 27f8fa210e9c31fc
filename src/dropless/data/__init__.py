"""Storage of training text: tokenizers (`data.tokenizer`) and the corpus readers and batches
(`data.corpus`). Used by training, eval, generate and convert; imports nothing above `config`."""
