"""A package, so that conftest.py's package-scoped cluster is shut down when the integration tests end."""
