"""breakgraph: an LLM serving engine whose steps are paced by the GPU."""

__version__ = "0.1.0"
