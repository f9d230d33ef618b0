"""Trajectory files and the Hugging Face datasets made from them."""
