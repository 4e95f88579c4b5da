"""The rows a run trains on: sources read, formats told apart, chat rendered, tokenized, prepared once and cached, streamed."""
