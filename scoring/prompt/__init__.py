"""Prompts to token ids as vLLM makes them: tokenizer, chat templates, conversations."""
