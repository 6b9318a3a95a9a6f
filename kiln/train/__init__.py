"""The training step and what it needs: optimizer, schedule, precision, metrics."""
