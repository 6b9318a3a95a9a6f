"""Plain nn.Module models that know nothing of parallelism."""
