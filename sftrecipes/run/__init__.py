"""A run's life on disk, torch-free: its lock, heartbeats, checkpoints and the records its processes leave."""
