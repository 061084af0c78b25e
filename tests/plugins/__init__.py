"""Toy extensions that plug into quantkit through its registries only (entry points), as another package's would:
docs/development.md's worked examples, run through the real pipeline by tests/test_plugins.py."""
