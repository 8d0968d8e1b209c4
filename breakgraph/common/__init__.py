"""Torch-free types that both the API process and the engine process import."""
