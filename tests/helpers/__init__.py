"""Shared test code (fixtures, harnesses, scripts launched by path), imported as `helpers.<name>`."""
