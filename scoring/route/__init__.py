"""The /route decision: cost model, candidate pass, routing state (in flight, sessions,
speculative entries)."""
