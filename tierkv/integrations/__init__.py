"""Integrations of tierkv with inference engines (transformers)."""
