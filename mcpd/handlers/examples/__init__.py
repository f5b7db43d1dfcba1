"""Handlers that ship with mcpd: a risk scorer with its rules, a text classifier, a sentence embedder."""
