"""Helpers shared by test modules (fixtures live in tests/conftest.py)."""
