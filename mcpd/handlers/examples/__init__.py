"""Handlers that ship with mcpd, each with a config block in etc/examples/handlers.toml: a risk
scorer and its rule table (risk_scorer.py), a text classifier (text_classifier.py) and a
sentence embedder (sentence_embedder.py), the two over one WordPiece tokenizer (wordpiece.py)."""
