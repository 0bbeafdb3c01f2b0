"""The model layer: weights loaders, tokenizer, chat template and the Llama forward."""
