"""torchft_like: per-step fault-tolerant data-parallel training for PyTorch."""
