"""Independent numpy references used by the integration tests."""
