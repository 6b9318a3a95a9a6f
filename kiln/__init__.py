"""kiln: a PyTorch-native training system for large language models."""

__version__ = "0.1.0"
