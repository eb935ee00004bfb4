"""Training the default model (see __main__.py)."""
