"""Training inside a rank: TRL's arguments, methods, precision, probes and metrics, guards, the final save, evaluation."""
