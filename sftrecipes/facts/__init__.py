"""What a model folder and its config say, torch-free: shapes layer by layer, folders, an adapter's base."""
