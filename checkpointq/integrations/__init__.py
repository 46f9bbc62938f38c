"""Adapters that plug checkpointq into other frameworks (each an optional extra)."""
