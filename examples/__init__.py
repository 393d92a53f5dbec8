"""Runnable examples: custom generators (select them with ``generator.cls=examples.MODULE:Class``)."""
