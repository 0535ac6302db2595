"""Helpers for butter's own tests: tiny models and fixtures."""
