"""Companion router module: consumers, event-bus server, KV index, scorer, admin. Imports core only."""
