"""One small file per decoder family, saying only what differs from its parent (model/registry.py names
them)."""
