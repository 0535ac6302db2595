"""`butter serve-bench`: synchronized request waves against a running server."""
