"""Training the bundled model: corpus, tokenizer, batched training forward, trainer, export."""
