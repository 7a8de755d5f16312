"""The pieces every decoder family shares, each written once: norms, rotary embeddings, projections and the
LM head, the gated MLP, and the KV pool. A family's model file (model/models/) composes them."""
