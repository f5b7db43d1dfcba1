"""Who may talk to mcpd: CURVE keys, the ZAP handler that checks them, and peer credentials.

See docs/PROTOCOL.md §1 ("Authentication") for what a client sees, and etc/mcpd.toml [security].
"""
