"""Handlers that ship with mcpd, each with a config block in etc/mcpd.toml: a risk scorer and
its rule table (risk_scorer.py), a text classifier and a sentence embedder."""
