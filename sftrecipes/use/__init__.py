"""After training: what people do with a trained run -- a terminal chat today; evaluation and serving hand-offs next."""
