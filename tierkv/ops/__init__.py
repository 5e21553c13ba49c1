"""The click CLI and the operator commands."""
