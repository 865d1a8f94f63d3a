"""Prompt suites and benchmark helpers."""
