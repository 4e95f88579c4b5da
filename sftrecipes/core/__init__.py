"""Below every stage: the error type, the repository's paths, processes as Linux shows them, page reading, the fork client."""
