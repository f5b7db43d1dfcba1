"""Wire protocol v1: framing, validation, error codes (see docs/PROTOCOL.md)."""
