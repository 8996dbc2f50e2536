"""The composition root: HTTP app, CLI, config, metrics."""
