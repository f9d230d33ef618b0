"""Generators: one protocol (token ids in, token ids and logprobs out) and its backends."""
