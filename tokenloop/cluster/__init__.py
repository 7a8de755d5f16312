"""Many engine cores behind one front door: replicas, routing, handoff."""
