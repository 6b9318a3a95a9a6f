"""Text -> tokens -> batches."""
