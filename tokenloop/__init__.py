"""tokenloop: a small LLM serving engine."""
